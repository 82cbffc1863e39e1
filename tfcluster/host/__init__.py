"""Everything that runs on a host: the shim and its parts, the TF server, the start-up probe.

These files are shipped flat to `<cluster_dir>/bin/` and run there with their own
directory first on `sys.path`, by whatever Python the host has (>= 3.8, standard library
only). That is why their names keep the `shim_` prefix: a generic name (`net`, `procs`)
could shadow a module TensorFlow or a user's script imports. This `__init__` is not shipped;
it only tells the launcher where the files are.
"""
import os

HOST_DIR = os.path.dirname(os.path.abspath(__file__))
