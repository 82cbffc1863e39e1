"""Writes the Keras progress samples next to it, as Keras prints them to a pipe (as
tfcluster runs scripts: stdout is no terminal). Run once per Keras, from this directory:

    python capture.py                            # Keras 3 (tf.keras with TF 2.21): keras3-*.txt
    TF_USE_LEGACY_KERAS=1 python capture.py      # tf_keras 2.21: tf_keras-*.txt

Each sample is `model.fit` (3 epochs of 20 batches, validation data, a sleep per batch so
that every batch updates the bar), then `model.evaluate` and `model.predict` with their own
bars, all with stdout a pipe. Data sizes: arrays (the size known), a tf.data dataset that
`repeat()`s with `steps_per_epoch`, and one whose cardinality is unknown (a `filter`)."""
import os
import subprocess
import sys

CHILD = r"""
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
keras = tf.keras
size, verbose = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
x = rng.random((640, 8), dtype="float32")
y = (rng.random(640) > 0.5).astype("float32")
model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.06))
val = (x[:64], y[:64])
if size == "known":
    model.fit(x, y, batch_size=32, epochs=3, validation_data=val, verbose=verbose, callbacks=[slow])
elif size == "repeat":
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    model.fit(ds, epochs=3, steps_per_epoch=20, validation_data=val, verbose=verbose, callbacks=[slow])
else:
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).filter(lambda a, b: True)
    model.fit(ds, epochs=3, validation_data=val, verbose=verbose, callbacks=[slow])
model.evaluate(x[:128], y[:128], batch_size=32, verbose=1)
model.predict(x[:64], batch_size=32, verbose=1)
print("done", flush=True)
"""


def main() -> None:
    keras = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3"
    for size in ("known", "repeat", "unknown"):
        for verbose in (1, 2):
            out = subprocess.run([sys.executable, "-c", CHILD, size, str(verbose)], check=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
            with open(f"{keras}-{size}-v{verbose}.txt", "wb") as f:
                f.write(out)


if __name__ == "__main__":
    main()
