"""One host's conversation: the `HostAgent` (agent.py) and what it speaks with the host's
shim: the bootstrap, the shim's JSON lines, the records of its answers, attached and held
starts, `up`'s one exec per host, and the fence. Nothing here knows of other hosts."""
