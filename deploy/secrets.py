"""`python -m deploy.secrets > .env`: fresh secrets for docker compose (which reads .env for ${...}).

KVMEM_INTERNAL_SECRET is required on every gRPC call between the services (services/common/auth.py);
KVMEM_REDIS_PASSWORD is redis' `requirepass` and goes into every service's KVMEM_REDIS_URL.
The local launcher generates both per launch itself.
"""

from __future__ import annotations

import sys

from services.common.auth import SECRET_ENV, new_secret


def env_file() -> str:
    """The .env text: one fresh value per secret."""
    return f"{SECRET_ENV}={new_secret()}\nKVMEM_REDIS_PASSWORD={new_secret()}\n"


if __name__ == "__main__":
    sys.stdout.write(env_file())
