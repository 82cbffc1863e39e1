"""paramiko, imported without `invoke`, its threads' log kept off the terminal.

paramiko imports `invoke` when it is installed (a dependency of paramiko >= 4) for one
feature: `Match exec` in an ssh config. That import is about 60 of paramiko's 140 ms here
(it pulls in unittest.mock, asyncio and a YAML parser), paid by every command that
connects. It is kept out of the first import of paramiko; ssh_config.py loads it, as
paramiko would have, when a config it parsed has a `Match exec` block.
"""
from __future__ import annotations

import logging
import sys

_blocked = "invoke" not in sys.modules and "paramiko" not in sys.modules
if _blocked:
    sys.modules["invoke"] = None          # `import invoke` raises ImportError: paramiko goes on
try:
    import paramiko  # noqa: E402
finally:
    if _blocked and "invoke" in sys.modules and sys.modules["invoke"] is None:
        del sys.modules["invoke"]         # a later `import invoke` works as ever

# paramiko's transport threads log a failed handshake (a drop past MaxStartups, a reset before
# the banner) at ERROR with its traceback. tfcluster configures no logging, so logging's last
# resort printed those lines on the user's terminal, even when the retry then succeeded. What
# failed reaches the user as tfcluster's own one-line error (ssh_connect.py).
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def enable_match_exec() -> None:
    """Give paramiko's config parser the `invoke` it left out (see above)."""
    import paramiko.config
    if paramiko.config.invoke is None:
        import invoke  # paramiko's own error when missing, as before
        paramiko.config.invoke = invoke


__all__ = ["paramiko", "enable_match_exec"]
