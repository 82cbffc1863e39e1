"""The cluster's hosts and servers: a session over every host of the plan (one agent each,
in parallel), `up`, `down`, `status` and `exec`, the checks before a run (preflight,
reachability), the servers' starts, the files shipped, the local lock and state, and a host
found lost or already down."""
