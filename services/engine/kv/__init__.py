"""KV memory: the device pool and its page formats, slot allocation with the prefix cache, the attention backend over
the pool, the recurrent layers' state, and the copies to and from the host store.
"""
