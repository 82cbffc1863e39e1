"""A launcher that runs the trainer in a Python of another environment (here: this
interpreter without its site-packages, as a bare system python would be)."""
import subprocess
import sys

subprocess.run([sys.executable, "-S", "-c", "import tensorflow"], check=True)
