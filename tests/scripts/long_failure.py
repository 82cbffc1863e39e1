"""A failure whose output is long: a deep traceback (recursion), or TensorFlow's own print
of a (32, 28, 28) tensor inside the exception's message, as Keras 3 prints a PerReplica
batch. `--tensor` for the tensor; the message ends in paragraphs of help either way."""
import sys

HELP = "\n\nWhat you should do instead:\n\n```\n" + "\n".join(f"help line {i}" for i in range(14)) + "\n```\n"


def deep(n):
    if n == 0:
        raise ValueError("the deep call failed" + HELP)
    return deeper(n - 1)


def deeper(n):      # two functions in turn: Python folds only a frame repeated as is
    return deep(n)


print("started", flush=True)
if "--tensor" in sys.argv:
    import tensorflow as tf
    raise ValueError(f"Attempt to convert a value ({tf.random.uniform((32, 28, 28))!r}) to a Tensor.")
deep(30)
