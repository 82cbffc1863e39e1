"""The effects: everything tfcluster does to hosts, in three rooms, each importing only the
ones below it (run -> cluster -> agent, an import-linter contract):

- `agent/`: one host's conversation with its shim (`HostAgent` and what it speaks);
- `cluster/`: the cluster's hosts and servers (a session over every host, `up`, `down`,
  `status`, `exec`, the checks before a run, a host found lost);
- `run/`: a `train` run (its supervisor, start, attempts, record, and what it does when a
  host is lost or drained).
"""
