"""The live view hides TensorFlow's multi-line INFO messages whole (the lines after the
first too), never a line of the script's own, and saves every byte."""
from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import local_spec, only_run, tfcluster
from tfcluster.watch.logmux import LogMux

# Captured from a coordinator-mode worker server (TF 2.21, protobuf's randomised DebugString
# marker on the first line): absl writes the whole message, ending in an empty line, at once.
SESSION_OPTIONS = (
    b"I0000 00:00:1795491528.738160   24466 eager_service_impl.cc:349] Creating sync eager service "
    b"context with rendezvous_id on host vm /job:worker/replica:0/task:0\n"
    b"I0000 00:00:1795491528.738208   24466 eager_service_impl.cc:355] SessionOptions: "
    b"goo.gle/debugproto  \n"
    b'device_count {\n  key: "CPU"\n  value: 1\n}\ndevice_count {\n  key: "GPU"\n  value: 0\n}\n'
    b"gpu_options {\n  experimental {\n  }\n}\nallow_soft_placement: true\n"
    b'experimental {\n  collective_group_leader: "/job:worker/replica:0/task:0"\n}\n'
    b"pluggable_device_options {\n  experimental {\n  }\n}\n\n"
    b"I0000 00:00:1795491529.306170   24465 kernel_and_device.cc:101] Ignoring error status when "
    b"releasing multi-device function handle UNIMPLEMENTED: Releasing a multi-device component "
    b"handle on a remote device is not yet implemented.\n")
# Captured from mirrored-mode worker:0 (3 workers), which runs the coordination service.
STRAGGLERS = (
    b"I0000 00:00:1795491799.666638   21212 coordination_service.cc:502] Waiting for 2/3 tasks to "
    b"connect.\n"
    b"I0000 00:00:1795491799.666647   21212 coordination_service.cc:505] Example stragglers:\n"
    b"/job:worker/replica:0/task:1\n/job:worker/replica:0/task:2\n"
    b"I0000 00:00:1795491799.666810   20458 coordination_service_agent.cc:245] Coordination agent "
    b"has successfully connected.\n")
# The same message from an older protobuf, without the marker: the body opens on the first line.
INLINE = (b"I0000 00:00:1795491528.738208   24466 eager_service_impl.cc:355] SessionOptions: "
          b'device_count {\n  key: "CPU"\n  value: 1\n}\nallow_soft_placement: true\n\n')
# Captured from a mirrored-mode worker on this CPU-only machine (TF 2.21, tensorflow-cpu): the
# start-up lines of one process, up to the CUDA probe's E line, none of them the script's.
CPU_ONLY_START = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1795735723.793301   14482 port.cc:153] oneDNN custom operations are on. You may see "
    b"slightly different numerical results due to floating-point round-off errors from different "
    b"computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
    b"I0000 00:00:1795735723.794197   14482 cudart_stub.cc:31] Could not find cuda drivers on your "
    b"machine, GPU will not be used.\n"
    b"E0000 00:00:1795735726.182250   14482 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA "
    b"error: Failed call to cuInit: UNKNOWN ERROR (303)\n")
# TF's type inference warning, one write, its message over many lines. Not produced here (four
# MWMS + tf.data scripts on TF 2.21, model.fit and custom loops, printed none): the body is a
# public TF 2.9 log's, byte for byte, the first line in TF 2.21's prefix, the node named as the
# issue's live view showed it.
TYPE_INFERENCE = (
    b"W0000 00:00:1795736119.583008   13590 type_inference.cc:339] Type inference failed. This "
    b"indicates an invalid graph that escaped type checking. Error message: INVALID_ARGUMENT: expected "
    b"compatible input types, but input 1:\n"
    b"type_id: TFT_OPTIONAL\nargs {\n  type_id: TFT_PRODUCT\n  args {\n    type_id: TFT_TENSOR\n"
    b"    args {\n      type_id: TFT_LEGACY_VARIANT\n    }\n  }\n}\n"
    b" is neither a subtype nor a supertype of the combined inputs preceding it:\n"
    b"type_id: TFT_OPTIONAL\nargs {\n  type_id: TFT_PRODUCT\n  args {\n    type_id: TFT_TENSOR\n"
    b"    args {\n      type_id: TFT_INT8\n    }\n  }\n}\n\n"
    b"\twhile inferring type of node 'AutoShardDataset'\n")
# Captured on a GPU machine (JAX 0.11.2, jax-cuda13-plugin, keras 3.15.1): the end of a mode
# keras-jax process 0 that trained and exited 0. Two of its absl lines carry a Status whose
# source trace, gRPC details and the rest of the message take lines of their own.
JAX_SHUTDOWN = (
    b"I1130 01:49:04.161221     688 preemption_sync_manager.cc:142] Cancelled call to retrieve "
    b"preemption notice. This is expected upon program shutdown.\n"
    b"I1130 01:49:04.161277     690 preemption_sync_manager.cc:115] Preemption sync protocol cancelled "
    b"by notifier: CANCELLED: Preemption notifier is being deleted.\n"
    b"=== Source Location Trace: ===\n"
    b"external/xla+/xla/pjrt/distributed/preemption/preemption_notifier.cc:84\n"
    b". This is expected during program shutdown.\n"
    b"I1130 01:49:04.161522     609 client.cc:152] Distributed task shutdown initiated.\n"
    b"I1130 01:49:04.162290     609 service.cc:114] Jax service shutting down\n"
    b"W1130 01:49:04.162889     752 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: UNAVAILABLE: "
    b"failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:23600: Failed to connect "
    b"to remote host: Connection refused\n"
    b"Additional GRPC error information from remote target coordination_service while calling "
    b"/xla.coordination.CoordinationService/WatchTasks:\n"
    b":UNAVAILABLE:failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:23600: Failed "
    b"to connect to remote host: Connection refused\n"
    b"=== Source Location Trace: === \n"
    b"external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89\n"
    b"\n")
# Each message alone, ending where its last line ends.
SESSION_ALONE = SESSION_OPTIONS[:SESSION_OPTIONS.index(b"I0000 00:00:1795491529")]
STRAGGLERS_ALONE = STRAGGLERS[:STRAGGLERS.index(b"I0000 00:00:1795491799.666810")]
TF_LINE = (b"I0000 00:00:1795491538.952755   25121 coordination_service.cc:505] Example stragglers:\n")


def live(*chunks: bytes, hide_noise: bool = True, tmp_path=None) -> list[str]:
    out = io.BytesIO()
    with LogMux(out, ["w"], color=False, hide_noise=hide_noise,
                save_dir=str(tmp_path) if tmp_path else None) as mux:
        for chunk in chunks:
            mux.feed("w", chunk)
    return [line.removeprefix("w │ ") for line in out.getvalue().decode().split("\n")[:-1]]


def test_session_options_proto_is_hidden_whole_and_saved_raw(tmp_path):
    data = b"server up\n" + SESSION_OPTIONS + b"step=1 loss=0.5\n"
    assert live(data, tmp_path=tmp_path) == ["server up", "step=1 loss=0.5"]
    assert (tmp_path / "w.log").read_bytes() == data


def test_stragglers_task_names_are_hidden_with_their_message():
    assert live(STRAGGLERS + b"step=1\n") == ["step=1"]


def test_a_proto_whose_first_line_opens_it_is_hidden_whole():
    assert live(INLINE + b"epoch 1\n") == ["epoch 1"]


def test_a_cpu_only_hosts_cuda_probe_is_hidden_with_the_rest_of_the_start_up(tmp_path):
    data = CPU_ONLY_START + b"epoch 1\n"
    assert live(data, tmp_path=tmp_path) == ["epoch 1"]
    assert (tmp_path / "w.log").read_bytes() == data


def test_a_type_inference_warning_is_hidden_up_to_its_nodes_name():
    assert live(b"epoch 0\n" + TYPE_INFERENCE + b"epoch 1\n") == ["epoch 0", "epoch 1"]


@pytest.mark.parametrize("user", ["epoch 1", "  indented by the script", "loss: 0.5", "type_id: 3 apples"])
def test_a_type_inference_warning_cut_short_ends_at_a_line_of_another_shape(user):
    cut = TYPE_INFERENCE[:TYPE_INFERENCE.index(b" is neither")]
    assert live(cut + f"{user}\nafter\n".encode()) == [user, "after"]


def test_jax_shutdown_statuses_are_hidden_with_their_traces_and_saved_raw(tmp_path):
    data = b"tfcluster-result: global_step=96 loss=0.089989\n" + JAX_SHUTDOWN
    assert live(data, tmp_path=tmp_path) == ["tfcluster-result: global_step=96 loss=0.089989"]
    assert (tmp_path / "w.log").read_bytes() == data


def test_a_status_trace_read_in_pieces_is_hidden_all_the_same():
    cut = JAX_SHUTDOWN.index(b"=== Source Location Trace: === \n")     # the second trace comes later
    assert live(JAX_SHUTDOWN[:cut], JAX_SHUTDOWN[cut:] + b"epoch 2\n") == ["epoch 2"]


@pytest.mark.parametrize("user", ["epoch 1", "", ". a sentence of the script's", "model.cc:3",
                                  ":ERR: the script's", "=== the script's banner ==="])
def test_a_script_line_after_a_hidden_line_is_shown_unless_a_status_trace_opened(user):
    assert live(TF_LINE.replace(b"Example stragglers:", b"Jax service shutting down")
                + f"{user}\nafter\n".encode()) == [user, "after"]


def test_verbose_shows_every_line_of_the_message():
    assert live(SESSION_OPTIONS, hide_noise=False) == SESSION_OPTIONS.decode().split("\n")[:-1]


@pytest.mark.parametrize("message", [SESSION_ALONE, STRAGGLERS_ALONE, INLINE, TYPE_INFERENCE],
                         ids=["proto", "names", "inline", "types"])
@pytest.mark.parametrize("user", ["epoch 1", "  indented by the script", "loss: 0.5", "", "}",
                                  "accuracy {"])
def test_a_script_line_right_after_a_whole_tf_message_is_shown(message, user):
    # the message is one write, so the script's next line comes after its last line
    assert live(message + f"{user}\nafter\n".encode()) == [user, "after"]


@pytest.mark.parametrize("user", ["epoch 1", "  indented by the script", "loss: 0.5", "", "}"])
def test_a_script_line_right_after_a_one_line_tf_message_is_shown(user):
    line = (b"W0000 00:00:1795491539.735822   24972 dataset.cc:997] Input of "
            b"GeneratorDatasetOp::Dataset will not be optimized.\n")
    assert live(line + f"{user}\n".encode()) == [user]


def test_a_message_ends_at_its_first_line_of_another_shape():
    header = b"I0000 00:00:1.5   1 eager_service_impl.cc:355] SessionOptions: goo.gle/debugstr    \n"
    assert live(header + b"device_count {\n  key: 1\n}\nepoch 1\n  two spaces\n") == [
        "epoch 1", "  two spaces"]
    assert live(header + b"a {\n   three_spaces: 1\n}\n") == ["   three_spaces: 1", "}"]
    assert live(TF_LINE + b"/job:worker/replica:0/task:1\nworker ready\n/job:x\n") == [
        "worker ready", "/job:x"]


@pytest.mark.parametrize("message", [SESSION_OPTIONS, STRAGGLERS, TYPE_INFERENCE], ids=["proto", "names", "types"])
def test_a_message_split_across_two_feeds_anywhere_is_still_hidden(message):
    data = b"a\n" + message + b"b\n"
    for cut in range(1, len(data)):
        assert live(data[:cut], data[cut:]) == ["a", "b"], cut


def test_a_message_fed_byte_by_byte_is_still_hidden():
    data = SESSION_OPTIONS + STRAGGLERS + b"done\n"
    assert live(*[data[i:i + 1] for i in range(len(data))]) == ["done"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(SESSION_OPTIONS + STRAGGLERS + INLINE) + 40), max_size=12))
def test_random_chunks_show_what_one_feed_shows(cuts):
    data = b"epoch 0\n" + SESSION_OPTIONS + b"  indented\n" + STRAGGLERS + b"\n" + INLINE + b"loss: 1\n"
    bounds = [0, *sorted(set(cuts)), len(data)]
    assert live(*[data[a:b] for a, b in zip(bounds, bounds[1:])]) == live(data) == [
        "epoch 0", "  indented", "", "loss: 1"]


def test_a_restarted_process_does_not_continue_the_last_ones_message():
    out = io.BytesIO()
    with LogMux(out, ["w"], color=False, hide_noise=True) as mux:
        mux.feed("w", SESSION_OPTIONS.split(b"device_count")[0])
        mux.close_task("w")
        mux.feed("w", b"device_count: 3\n")
    assert out.getvalue() == b"w \xe2\x94\x82 device_count: 3\n"


def test_only_the_lines_continuing_a_message_are_cut_from_the_next_batch(monkeypatch):
    out = io.BytesIO()
    mux = LogMux(out, ["w"], color=False, hide_noise=True)
    head, body = SESSION_OPTIONS.split(b"device_count {\n  key: \"GPU\"")
    mux.feed("w", head)
    calls = []
    monkeypatch.setattr(LogMux, "_shown_lines", lambda self, t, lines: calls.append(lines) or lines)
    mux.feed("w", b'device_count {\n  key: "GPU"\n  value: 0\n}\n\n' + b"step=1\n" * 1000)
    assert calls == [] and out.getvalue() == b"w \xe2\x94\x82 step=1\n" * 1000


# absl-Python's format is TF's C++ one with a Python file (a script's absl.logging.info under
# absl.app.run): the script's own lines, never hidden.
ABSL_PY = (b"I1124 03:31:18.123456 140234 myscript.py:12] step=5 loss=0.3\n"
           b"W1124 03:31:18.223456 140234 myscript.py:13] loss is rising\n")
CPP_WARNING = b"W0000 00:00:1795491539.735822   24972 cpu_feature_guard.h:210] Not optimized.\n"


def test_the_scripts_own_absl_info_and_warning_lines_are_shown():
    assert live(ABSL_PY) == ["I1124 03:31:18.123456 140234 myscript.py:12] step=5 loss=0.3",
                             "W1124 03:31:18.223456 140234 myscript.py:13] loss is rising"]


def test_tf_cpp_lines_beside_the_scripts_absl_lines_are_still_hidden():
    info, warning = ABSL_PY.splitlines(keepends=True)
    assert live(TF_LINE + info + CPP_WARNING + warning) == [info.decode()[:-1], warning.decode()[:-1]]


def test_an_absl_python_line_ending_in_a_colon_opens_no_hidden_message():
    line = b"I1124 03:31:18.123456 140234 myscript.py:20] Example stragglers:\n"
    assert live(line + b"/job:worker/replica:0/task:1\n") == [
        line[:-1].decode(), "/job:worker/replica:0/task:1"]


def test_a_batch_of_absl_python_lines_keeps_the_fast_path(monkeypatch):
    calls = []
    monkeypatch.setattr(LogMux, "_shown_lines", lambda self, t, lines: calls.append(lines) or lines)
    assert live(ABSL_PY * 100) == ABSL_PY.decode().split("\n")[:-1] * 100 and calls == []


# Captured from mirrored-mode worker:0 under absl.app.run: TF's Python logger's own line, then
# the same record through absl's handler on the root logger.
TF_PY = b"INFO:tensorflow:Check health not enabled.\n"
TF_PY_ECHO = (b"I1124 04:21:13.686739 140642569231232 collective_all_reduce_strategy.py:652] Check "
              b"health not enabled.\n")


def test_absls_echo_of_a_tf_python_line_is_hidden_and_the_first_copy_shown():
    data = ABSL_PY + TF_PY + TF_PY_ECHO + ABSL_PY
    assert live(data) == live(ABSL_PY) + ["INFO:tensorflow:Check health not enabled."] + live(ABSL_PY)
    for cut in range(1, len(data)):
        assert live(data[:cut], data[cut:]) == live(data), cut
    assert live(data, hide_noise=False) == data.decode().split("\n")[:-1]


@pytest.mark.parametrize("before, after", [
    (TF_PY, TF_PY_ECHO.replace(b"Check health", b"Health")),     # another message
    (TF_PY, b"x\n" + TF_PY_ECHO),                                  # not straight after it
    (TF_PY.replace(b"INFO", b"ERROR"), TF_PY_ECHO.replace(b"I1124", b"E1124")),  # errors stay
    (TF_PY.replace(b"INFO", b"WARNING"), TF_PY_ECHO)])             # another level
def test_only_an_info_or_warning_echo_straight_after_its_tf_line_is_hidden(before, after):
    assert live(before + after) == (before + after).decode().split("\n")[:-1]


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_coordinator_run_hides_session_options_live_and_saves_them(tmp_path, home):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = local_spec(tmp_path, mode="coordinator", script="template:coordinator",
                      args=["--steps", "20", "--log_every", "10"], ps=1, workers=2, chief=1)
    result = tfcluster("train", str(spec), home=home, cwd=cwd, timeout=110)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = (only_run(cwd / "runs") / "ps-0.log").read_text()
    assert "\ndevice_count {\n" in saved and "\nallow_soft_placement: true\n" in saved
    live_lines = [line.split("│ ", 1)[1] for line in result.stdout.splitlines() if "│ " in line]
    assert any(line.startswith("step=20 ") for line in live_lines), result.stdout
    assert not [line for line in live_lines
                if line in ("", "}", "  }") or line.endswith(" {") or line.startswith("  key:")]
    # TF with CUDA support on a host without a GPU driver logs its CUDA probe's failure as an E
    # line (the wheel this suite ran on did): saved, never shown
    assert not [line for line in live_lines if "cuInit" in line], result.stdout
