"""Writes the Keras samples of scripts that call `model.fit` more than once, and of tf_keras'
MultiWorkerMirroredStrategy, as Keras prints them to a pipe (as tfcluster runs scripts).
Run once from this directory (about a minute):

    python capture.py

fits-*.txt, for Keras 3 (`tf.keras` of TF 2.21) and tf_keras 2.21 (TF_USE_LEGACY_KERAS=1),
verbose=1 and 2: `fit(epochs=2)`; `fit(epochs=1)` (Keras prints no `Epoch` line for one
epoch); `evaluate` (a bar); `fit(epochs=1)` of another size with validation data;
`evaluate(verbose=2)`; `fit(epochs=3, initial_epoch=1)`; `predict`. 20 + 20 + 20 + 10 +
20 + 20 = 110 training steps in 4 fits, 20 batches an epoch but the fourth's 10.

tf_keras-mwms-v1.txt: worker 0 of two tf_keras workers under MultiWorkerMirroredStrategy
(TF_CONFIG on loopback), 2 epochs of 10 batches, verbose=1: the bar's loss within an
epoch is summed over the workers, the epoch's last update is the mean."""
import json
import os
import socket
import subprocess
import sys

FITS = r"""
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
keras = tf.keras
verbose = int(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.random((640, 8), dtype="float32")
y = (rng.random(640) > 0.5).astype("float32")
model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.06))
val = (x[:64], y[:64])
model.fit(x, y, batch_size=32, epochs=2, verbose=verbose, callbacks=[slow])
model.fit(x, y, batch_size=32, epochs=1, verbose=verbose, callbacks=[slow])
model.evaluate(x[:128], y[:128], batch_size=32, verbose=1)
model.fit(x[:320], y[:320], batch_size=32, epochs=1, validation_data=val, verbose=verbose, callbacks=[slow])
model.evaluate(x[:128], y[:128], batch_size=32, verbose=2)
model.fit(x, y, batch_size=32, epochs=3, initial_epoch=1, verbose=verbose, callbacks=[slow])
model.predict(x[:64], batch_size=32, verbose=1)
print("done", flush=True)
"""

MWMS = r"""
import os, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.random((320, 8), dtype="float32")
y = (rng.random(320) > 0.5).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy")
slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.06))
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
model.fit(data, epochs=2, steps_per_epoch=10, verbose=1, callbacks=[slow])
print("done", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    for keras, legacy in (("keras3", "0"), ("tf_keras", "1")):
        env = {**os.environ, "TF_USE_LEGACY_KERAS": legacy}
        for verbose in (1, 2):
            out = subprocess.run([sys.executable, "-c", FITS, str(verbose)], check=True, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
            with open(f"{keras}-fits-v{verbose}.txt", "wb") as f:
                f.write(out)
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    procs = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CONFIG": json.dumps(config)}
        procs.append(subprocess.Popen([sys.executable, "-c", MWMS], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    with open("tf_keras-mwms-v1.txt", "wb") as f:
        f.write(outs[0])


if __name__ == "__main__":
    main()
