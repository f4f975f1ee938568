"""Page moves: a step's K/V rows written (plain, or quantised with their gather + dequantise: kv_triton), pages
restored from host memory (restore), and page summaries with page scoring (summaries_triton; summaries_cupy for
the cupy tier).
"""
