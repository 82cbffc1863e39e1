"""The spec loader: every rejection with its exact message, exact layouts, and no crash on junk."""
from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfcluster.errors import SpecError, UsageError
from tfcluster.plan import build_plan
from tfcluster.spec import (
    Host,
    Job,
    Restart,
    Slot,
    Spec,
    SshSettings,
    Train,
    check_train_files,
    layout_tasks,
    load_spec,
    templates,
    with_train_overrides,
)

HEAD = """\
name: t
hosts:
  - {name: a, address: 10.0.0.1}
  - {name: g, address: 10.0.0.2, gpus: 4}
"""
JOBS = """\
jobs:
  ps: {count: 1, hosts: [a], port: 2222}
  worker: {count: 2, hosts: [a], port: 2300}
"""
BASE = HEAD + JOBS          # lines 1-7; anything appended starts on line 8


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error(path: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


# (id, yaml text, "LINE: field: problem" after "FILE:")
REJECTIONS = [
    # --- document level
    ("empty", "", "1: spec: file is empty; expected a mapping with name, hosts and jobs"),
    ("comments-only", "# nothing\n", "1: spec: file is empty; expected a mapping with name, hosts and jobs"),
    ("root-list", "- a\n- b\n", "1: spec: must be a mapping, got a list"),
    ("root-scalar", "hello\n", "1: spec: must be a mapping, got 'hello'"),
    ("syntax", "name: t\nhosts: [a\n", "3: yaml: did not find expected ',' or ']' (while parsing a flow sequence)"),
    ("two-docs", "name: a\n---\nname: b\n", "2: yaml: a second YAML document; a spec is a single document"),
    ("tab-indent", "name: t\nhosts:\n\t- {name: a, address: localhost}\n",
     "3: yaml: a tab character; YAML indents with spaces only (found character that cannot start any token "
     "(while scanning for the next token))"),
    ("nul-byte", "name: t\nx: a\0b\n", "2: yaml: control characters are not allowed"),
    ("anchor", BASE + "env: &e {A: b}\n", "8: yaml: YAML anchors/aliases are not supported"),
    ("tag", BASE + "python: !!str python3\n", "8: yaml: YAML tags are not supported (tag:yaml.org,2002:str)"),
    ("deep", "name: " + "[" * 40 + "]" * 40 + "\n", "1: yaml: nested more than 32 levels deep"),
    ("unknown-top", BASE + "nmae: x\n", "8: nmae: unknown key 'nmae'; did you mean 'name'?"),
    ("unknown-top-far", BASE + "zzz: x\n",
     "8: zzz: unknown key 'zzz'; expected one of: name, python, workdir, env, secret_env, public_env, "
     "ssh, hosts, jobs, train, tf_ports"),
    ("duplicate-top", BASE + "name: u\n", "8: name: duplicate key (first on line 1)"),
    ("missing-name", "hosts: [{name: a, address: b}]\njobs: {}\n", "1: name: missing required key"),
    ("missing-jobs", HEAD, "1: jobs: missing required key"),
    ("non-string-key", BASE + "[a]: b\n", "8: spec: keys must be strings, got a list"),
    # --- name, python, workdir
    ("name-bad", BASE.replace("name: t", "name: -t"), "1: name: invalid name '-t'"),
    ("name-dotdot", BASE.replace("name: t", "name: a..b"), "1: name: invalid name 'a..b'"),
    ("name-long", BASE.replace("name: t", "name: " + "x" * 64), "1: name: invalid name '" + "x" * 64 + "'"),
    ("name-null", BASE.replace("name: t", "name:"), "1: name: must be a string, got null"),
    ("python-space", BASE + "python: /opt/my python\n",
     "8: python: must not contain whitespace or control characters: '/opt/my python'"),
    ("python-newline", BASE + 'python: "py\\nthon"\n',
     "8: python: must not contain whitespace or control characters: 'py\\nthon'"),
    ("workdir-list", BASE + "workdir: [a]\n", "8: workdir: must be a string, got a list"),
    ("workdir-space", BASE + "workdir: ~/my dir\n",
     "8: workdir: must not contain whitespace or control characters: '~/my dir'"),
    ("workdir-relative", BASE + "workdir: relwd\n", "8: workdir: must be absolute or start with ~/: 'relwd'"),
    ("workdir-dot", BASE + "workdir: ./w\n", "8: workdir: must be absolute or start with ~/: './w'"),
    # --- env
    ("env-list", BASE + "env: {A: [1]}\n", "8: env.A: value must be a string, got a list"),
    ("env-map", BASE + "env:\n  A: {b: c}\n", "9: env.A: value must be a string, got a mapping"),
    ("env-null", BASE + "env:\n  A:\n", "9: env.A: value must be a string, got null"),
    ("env-tilde", BASE + "env: {A: ~}\n", "8: env.A: value must be a string, got null"),
    ("env-name", BASE + "env: {1A: x}\n", "8: env.1A: invalid variable name"),
    ("env-dup", BASE + "env:\n  A: x\n  A: y\n", "10: env.A: duplicate key (first on line 9)"),
    ("env-not-map", BASE + "env: [A]\n", "8: env: must be a mapping, got a list"),
    # --- ssh
    ("ssh-sexagesimal", BASE + "ssh: {port: 22:22}\n", "8: ssh.port: must be a decimal integer, got '22:22'"),
    ("ssh-hex", BASE + "ssh: {port: 0x10}\n", "8: ssh.port: must be a decimal integer, got '0x10'"),
    ("ssh-underscore", BASE + "ssh: {port: 1_000}\n", "8: ssh.port: must be a decimal integer, got '1_000'"),
    ("ssh-exp", BASE + "ssh: {port: 1e3}\n", "8: ssh.port: must be a decimal integer, got '1e3'"),
    ("ssh-bool", BASE + "ssh: {port: true}\n", "8: ssh.port: must be a decimal integer, got 'true'"),
    ("ssh-quoted", BASE + 'ssh: {port: "22"}\n', "8: ssh.port: must be a decimal integer, got the quoted string '22' (write it without quotes)"),
    ("ssh-quoted-word", BASE + 'ssh: {port: "two"}\n', "8: ssh.port: must be a decimal integer, got the quoted string 'two'"),
    ("ssh-range", BASE + "ssh: {port: 65536}\n", "8: ssh.port: must be an integer from 1 to 65535, got 65536"),
    ("ssh-huge", BASE + "ssh: {port: " + "9" * 5000 + "}\n",
     "8: ssh.port: must be an integer from 1 to 65535, got " + "9" * 20),
    ("ssh-unknown", BASE + "ssh: {usr: x}\n", "8: ssh.usr: unknown key 'usr'; did you mean 'user'?"),
    ("ssh-policy", BASE + "ssh: {host_key_policy: accept_new}\n",
     "8: ssh.host_key_policy: unknown host key policy 'accept_new'; did you mean 'accept-new'?"),
    ("ssh-timeout-zero", BASE + "ssh: {connect_timeout: 0}\n",
     "8: ssh.connect_timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got '0'"),
    ("ssh-timeout-huge", BASE + "ssh: {connect_timeout: 99999999999h}\n",
     "8: ssh.connect_timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most "
     "8784h, a year); got '99999999999h'"),
    ("ssh-timeout-word", BASE + "ssh: {connect_timeout: soon}\n",
     "8: ssh.connect_timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got 'soon'"),
    ("ssh-user", BASE + "ssh: {user: -oProxyCommand}\n", "8: ssh.user: invalid user name '-oProxyCommand'"),
    ("ssh-jump", BASE + "ssh: {jump_host: 'b;rm'}\n", "8: ssh.jump_host: must not contain shell metacharacter ';': 'b;rm'"),
    ("ssh-jump-password", BASE + "ssh: {jump_host: 'u:hunter2pw@bastion'}\n",
     "8: ssh.jump_host: must be [user@]host[:port], with no password (SSH logs in with a key here): "
     "'u:***@bastion'"),
    ("ssh-jump-port", BASE + "ssh: {jump_host: 'u@b:99999'}\n",
     "8: ssh.jump_host: port must be from 1 to 65535: 'u@b:99999'"),
    ("ssh-jump-port-0", BASE + "ssh: {jump_host: 'b:0'}\n", "8: ssh.jump_host: port must be from 1 to 65535: 'b:0'"),
    ("ssh-jump-no-port", BASE + "ssh: {jump_host: 'b:'}\n", "8: ssh.jump_host: must be [user@]host[:port]: 'b:'"),
    ("ssh-null", BASE + "ssh:\n", "8: ssh: must be a mapping, got null"),
    # --- hosts
    ("hosts-empty", "name: t\nhosts: []\njobs: {}\n", "2: hosts: must list at least one host"),
    ("hosts-map", "name: t\nhosts: {a: b}\njobs: {}\n", "2: hosts: must be a list, got a mapping"),
    ("host-missing-address", "name: t\nhosts:\n  - name: a\njobs: {}\n", "3: hosts[0].address: missing required key"),
    ("host-unknown-key", "name: t\nhosts:\n  - {name: a, address: b, gpu: 1}\njobs: {}\n",
     "3: hosts[0].gpu: unknown key 'gpu'; did you mean 'gpus'?"),
    ("host-dup", HEAD + "  - {name: a, address: 10.0.0.3}\n" + JOBS,
     "5: hosts[2].name: duplicate host name 'a' (first on line 3)"),
    ("host-name", "name: t\nhosts:\n  - {name: 'a b', address: x}\njobs: {}\n", "3: hosts[0].name: invalid name 'a b'"),
    ("host-gpus-neg", "name: t\nhosts:\n  - {name: a, address: x, gpus: -1}\njobs: {}\n",
     "3: hosts[0].gpus: must be an integer from 0 to 4096, got -1"),
    ("addr-space", "name: t\nhosts:\n  - {name: a, address: 'x y'}\njobs: {}\n",
     "3: hosts[0].address: must not contain whitespace or control characters: 'x y'"),
    ("addr-dash", "name: t\nhosts:\n  - {name: a, address: -oProxyCommand=x}\njobs: {}\n",
     "3: hosts[0].address: must not start with '-' (ssh would take it for an option): '-oProxyCommand=x'"),
    ("addr-semicolon", "name: t\nhosts:\n  - {name: a, address: 'x;reboot'}\njobs: {}\n",
     "3: hosts[0].address: must not contain shell metacharacter ';': 'x;reboot'"),
    ("addr-dollar", "name: t\nhosts:\n  - {name: a, address: '$(id)'}\njobs: {}\n",
     "3: hosts[0].address: must not contain shell metacharacter '$': '$(id)'"),
    ("addr-backtick", "name: t\nhosts:\n  - {name: a, address: '`id`'}\njobs: {}\n",
     "3: hosts[0].address: must not contain shell metacharacter '`': '`id`'"),
    ("addr-label", "name: t\nhosts:\n  - {name: a, address: bad_host.example}\njobs: {}\n",
     "3: hosts[0].address: not a valid hostname, IPv4 or IPv6 address: 'bad_host.example'"),
    ("addr-ipv4", "name: t\nhosts:\n  - {name: a, address: 10.1.0.300}\njobs: {}\n",
     "3: hosts[0].address: not a valid hostname, IPv4 or IPv6 address: '10.1.0.300'"),
    ("addr-unspecified", "name: t\nhosts:\n  - {name: a, address: 0.0.0.0}\njobs: {}\n",
     "3: hosts[0].address: is no host's address (it stands for every interface of a listening socket; "
     "dialled, it is this machine): give the host's name or IP: '0.0.0.0'"),
    ("addr-unspecified-v6", "name: t\nhosts:\n  - {name: a, address: '::'}\njobs: {}\n",
     "3: hosts[0].address: is no host's address (it stands for every interface of a listening socket; "
     "dialled, it is this machine): give the host's name or IP: '::'"),
    ("addr-user", "name: t\nhosts:\n  - {name: a, address: root@x}\njobs: {}\n",
     "3: hosts[0].address: not a valid hostname, IPv4 or IPv6 address: 'root@x'"),
    ("host-ssh-port", "name: t\nhosts:\n  - {name: a, address: x, ssh: {port: 0}}\njobs: {}\n",
     "3: hosts[0].ssh.port: must be an integer from 1 to 65535, got 0"),
    # --- jobs
    ("jobs-unknown", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 2222}\n  wokrer: {count: 1, hosts: [a], port: 2300}\n",
     "7: jobs.wokrer: unknown job 'wokrer'; did you mean 'worker'?"),
    ("jobs-dup", BASE + "  worker: {count: 1, hosts: [a], port: 2400}\n",
     "8: jobs.worker: duplicate key (first on line 7)"),
    ("job-unknown-key", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], prot: 2222}\n",
     "6: jobs.ps.prot: unknown key 'prot'; did you mean 'port'?"),
    ("job-missing-port", HEAD + "jobs:\n  ps: {count: 1, hosts: [a]}\n", "6: jobs.ps.port: missing required key"),
    ("job-missing-count", HEAD + "jobs:\n  ps: {hosts: [a], port: 1}\n", "6: jobs.ps.count: missing required key"),
    ("job-count-neg", HEAD + "jobs:\n  ps: {count: -1, hosts: [a], port: 1}\n",
     "6: jobs.ps.count: must be an integer from 0 to 10000, got -1"),
    ("job-port-range", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 0}\n",
     "6: jobs.ps.port: must be an integer from 1 to 65535, got 0"),
    ("job-port-room", HEAD + "jobs:\n  ps: {count: 4, hosts: [a], port: 65534}\n",
     "6: jobs.ps.port: 4 tasks on host a need ports 65534-65537, past 65535"),
    ("job-unknown-host", HEAD + "jobs:\n  ps: {count: 1, hosts: [aa], port: 1}\n",
     "6: jobs.ps.hosts[0]: unknown host 'aa'; did you mean 'a'?"),
    ("job-host-twice", HEAD + "jobs:\n  ps: {count: 1, hosts: [a, a], port: 1}\n",
     "6: jobs.ps.hosts[1]: host 'a' is listed twice"),
    ("job-hosts-empty", HEAD + "jobs:\n  ps: {count: 1, hosts: [], port: 1}\n", "6: jobs.ps.hosts: must name at least one host"),
    ("job-count-per-gpu", HEAD + "jobs:\n  worker: {count: 1, per_gpu: true, hosts: [g], port: 1}\n",
     "6: jobs.worker.per_gpu: cannot be combined with 'count' (per_gpu starts one task per GPU)"),
    ("job-per-gpu-bool", HEAD + "jobs:\n  worker: {per_gpu: yes, hosts: [g], port: 1}\n",
     "6: jobs.worker.per_gpu: must be true or false, got 'yes'"),
    ("job-per-gpu-no-gpus", HEAD + "jobs:\n  worker: {per_gpu: true, hosts: [g, a], port: 1}\n",
     "6: jobs.worker.hosts[1]: per_gpu needs GPUs but host a has none (set gpus: on the host)"),
    ("job-per-gpu-gpus", HEAD + "jobs:\n  worker: {per_gpu: true, gpus: 2, hosts: [g], port: 1}\n",
     "6: jobs.worker.gpus: cannot be combined with per_gpu (per_gpu gives each task one GPU)"),
    ("job-tasks-mixed", HEAD + "jobs:\n  worker: {tasks: ['a:1'], port: 1}\n",
     "6: jobs.worker.port: cannot be combined with 'tasks' (list every task, or use count/per_gpu, hosts and port)"),
    ("job-task-form", HEAD + "jobs:\n  worker:\n    tasks:\n      - a:1\n      - a\n",
     "9: jobs.worker.tasks[1]: must be 'host:port', got 'a'"),
    ("job-task-host", HEAD + "jobs:\n  worker: {tasks: ['b:1']}\n", "6: jobs.worker.tasks[0]: unknown host 'b'; expected one of: a, g"),
    ("job-task-port", HEAD + "jobs:\n  worker: {tasks: ['a:70000']}\n",
     "6: jobs.worker.tasks[0]: port must be an integer from 1 to 65535, got '70000'"),
    ("job-ps-gpus", HEAD + "jobs:\n  ps:\n    count: 1\n    hosts: [g]\n    port: 1\n    gpus: 1\n",
     "10: jobs.ps.gpus: ps tasks never get GPUs"),
    ("job-ps-per-gpu", HEAD + "jobs:\n  ps: {per_gpu: true, hosts: [g], port: 1}\n", "6: jobs.ps.per_gpu: ps tasks never get GPUs"),
    ("job-not-map", HEAD + "jobs:\n  ps: 3\n", "6: jobs.ps: must be a mapping, got '3'"),
    ("too-many-tasks", HEAD + "jobs:\n  ps: {count: 10000, hosts: [a], port: 1}\n  worker: {count: 10000, hosts: [g], port: 1}\n",
     "6: jobs: 20000 tasks in all; at most 10000 are supported"),
    # --- GPU and port cross checks
    ("gpu-over", HEAD + "jobs:\n  chief: {count: 1, hosts: [g], port: 2000, gpus: 2}\n"
     "  ps: {count: 1, hosts: [a], port: 2222}\n  worker: {per_gpu: true, hosts: [g], port: 2300}\n",
     "8: jobs.worker: host g has 4 GPUs but its tasks need 6"),
    ("gpu-none", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 2222}\n  worker: {count: 1, hosts: [a], port: 2300, gpus: 1}\n",
     "7: jobs.worker: host a has 0 GPUs but its tasks need 1"),
    ("port-clash", HEAD + "jobs:\n  ps: {count: 1, hosts: [g], port: 2222}\n  worker: {count: 2, hosts: [g], port: 2221}\n",
     "7: jobs.worker: worker:1 and ps:0 both use g:2222"),
    ("port-clash-tasks", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 1}\n  worker: {tasks: ['g:5', 'g:5']}\n",
     "7: jobs.worker: worker:1 and worker:0 both use g:5"),
    ("port-clash-same-address", "name: t\nhosts:\n  - {name: a, address: h.example}\n  - {name: b, address: h.example}\n"
     "jobs:\n  ps: {count: 1, hosts: [a], port: 2222}\n  worker: {count: 1, hosts: [b], port: 2222}\n",
     "7: jobs.worker: worker:0 and ps:0 both use port 2222 of h.example (hosts b and a)"),
    ("port-clash-loopback", "name: t\nhosts:\n  - {name: h1, address: 127.0.0.2}\n  - {name: h2, address: 127.0.0.3}\n"
     "jobs:\n  ps: {count: 1, hosts: [h1], port: 2222}\n  worker: {count: 1, hosts: [h2], port: 2222}\n",
     "7: jobs.worker: worker:0 and ps:0 both use port 2222 of this machine (hosts h2 at 127.0.0.3 and "
     "h1 at 127.0.0.2): 127.0.0.x addresses are one machine and a TF server binds every interface"),
    # --- modes
    ("no-ps", HEAD + "jobs:\n  worker: {count: 1, hosts: [a], port: 2300}\n", "5: jobs: mode between-graph needs at least one ps task"),
    ("ps-zero", HEAD + "jobs:\n  ps: {count: 0, hosts: [a], port: 1}\n  worker: {count: 1, hosts: [a], port: 2300}\n",
     "6: jobs.ps: mode between-graph needs at least one ps task"),
    ("worker-zero", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 1}\n  worker: {count: 0, hosts: [a], port: 2300}\n",
     "7: jobs.worker: mode between-graph needs at least one worker task"),
    ("no-worker-mirrored", HEAD + "jobs:\n  chief: {count: 1, hosts: [a], port: 1}\ntrain: {mode: mirrored}\n",
     "5: jobs: mode mirrored needs at least one worker task"),
    ("classic-no-ps", HEAD + "jobs:\n  worker: {count: 1, hosts: [a], port: 2300}\ntrain: {mode: classic}\n",
     "5: jobs: mode classic needs at least one ps task"),
    ("coordinator-no-chief", BASE + "train: {mode: coordinator}\n", "5: jobs: mode coordinator needs a chief job (it runs the coordinator)"),
    ("mirrored-ps", BASE + "train: {mode: mirrored}\n",
     "6: jobs.ps: mode mirrored takes no ps tasks: MultiWorkerMirroredStrategy uses no parameter servers"),
    ("two-chiefs", HEAD + "jobs:\n  chief: {count: 2, hosts: [a], port: 1}\n  ps: {count: 1, hosts: [a], port: 2222}\n"
     "  worker: {count: 1, hosts: [a], port: 2300}\n", "6: jobs.chief: at most 1 chief task, got 2"),
    # --- train
    ("mode-typo", BASE + "train: {mode: betwen-graph}\n", "8: train.mode: unknown mode 'betwen-graph'; did you mean 'between-graph'?"),
    ("hang-after-negative", BASE + "train: {mode: between-graph, checks: {hang_after: -1}}\n",
     "8: train.checks.hang_after: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most "
     "8784h, a year), or off; got '-1'"),
    ("train-unknown", BASE + "train: {scrpt: x.py}\n", "8: train.scrpt: unknown key 'scrpt'; did you mean 'script'?"),
    # a key of the other level: where it belongs, not the closest name there
    ("env-under-train", BASE + "train:\n  script: x.py\n  env: {A: '1'}\n",
     "10: train.env: env belongs at the spec's top level, not under train"),
    ("mode-at-top", BASE + "mode: mirrored\n", "8: mode: mode belongs under train:, not at the spec's top level"),
    ("template-unknown", BASE + "train: {script: 'template:nope'}\n", "8: train.script: unknown template 'nope'; expected one of: {templates}"),
    ("files-not-list", BASE + "train: {files: sub}\n", "8: train.files: must be a list, got 'sub'"),
    ("args-unknown", BASE + "train:\n  args: ['--a', 1, '--steps={steps}']\n",
     "9: train.args[2]: unknown placeholder {steps}; known: job, index, ps_hosts, worker_hosts, chief_hosts, workdir, num_workers"),
    ("args-format-spec", BASE + "train:\n  args: ['{index:03d}']\n",
     "9: train.args[0]: unknown placeholder {index:03d}; known: job, index, ps_hosts, worker_hosts, chief_hosts, workdir, num_workers"),
    ("args-positional", BASE + "train:\n  args: ['{}']\n",
     "9: train.args[0]: unknown placeholder {}; known: job, index, ps_hosts, worker_hosts, chief_hosts, workdir, num_workers"),
    ("args-brace", BASE + "train:\n  args:\n    - ok\n    - 'x}'\n",
     "11: train.args[1]: malformed placeholder in 'x}' (Single '}' encountered in format string); write {{ and }} for literal braces"),
    ("args-open", BASE + "train:\n  args: ['{job']\n",
     "9: train.args[0]: malformed placeholder in '{job' (expected '}' before end of string); write {{ and }} for literal braces"),
    ("args-list-item", BASE + "train:\n  args: [[a]]\n", "9: train.args[0]: must be a string, got a list"),
    ("args-null-item", BASE + "train:\n  args:\n    -\n", "10: train.args[0]: must be a string, got null"),
    ("restart-policy", BASE + "train: {restart: {policy: on_failure}}\n",
     "8: train.restart.policy: unknown restart policy 'on_failure'; did you mean 'on-failure'?"),
    ("restart-max", BASE + "train: {restart: {max_restarts: -2}}\n",
     "8: train.restart.max_restarts: must be an integer from 0 to 1000000, got -2"),
    ("restart-max-no-policy", BASE + "train: {restart: {max_restarts: 2}}\n",
     "8: train.restart.max_restarts: restarts nothing without a policy (the default is never): set "
     "train.restart.policy to on-failure or exit-code"),
    ("timeout-zero", BASE + "train: {timeout: 0s}\n",
     "8: train.timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got '0s'"),
    ("timeout-unit", BASE + "train: {timeout: 3d}\n",
     "8: train.timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got '3d'"),
    ("timeout-list", BASE + "train: {timeout: [1]}\n",
     "8: train.timeout: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got a list"),
    ("stop-grace-long", BASE + "train: {stop_grace: 2h}\n",
     "8: train.stop_grace: must be more than 0 and at most 3600s; got '2h'"),
    ("stop-grace-zero", BASE + "train: {stop_grace: 0}\n",
     "8: train.stop_grace: must be a positive number of seconds or a duration like 90s, 30m, 2h (at most 8784h, a year); got '0'"),
    ("keras-typo", BASE + "train:\n  mode: mirrored\n  keras: legacey\n",
     "10: train.keras: unknown keras 'legacey'; did you mean 'legacy'?"),
    ("keras-bool", BASE + "train: {keras: true}\n", "8: train.keras: unknown keras 'true'; expected one of: auto, legacy"),
    ("keras-env-contradicts", BASE.replace("jobs:", "env: {TF_USE_LEGACY_KERAS: '0'}\njobs:")
     + "train:\n  keras: legacy\n",
     "10: train.keras: legacy sets TF_USE_LEGACY_KERAS=1, but env: sets it to '0'"),
    ("python-relative-path", "python: venv/bin/python\n" + BASE,
     "1: python: must be a name on PATH, absolute, or start with ~/: 'venv/bin/python' would be looked for from "
     "each process's own directory (a script's is its run's)"),
    ("task-on-ssh-default-port", HEAD + "jobs:\n  ps: {count: 1, hosts: [a], port: 22}\n",
     "6: jobs.ps: ps:0 uses port 22 of a, SSH's default port, where tfcluster reaches the host: its TF "
     "server could not listen there"),
    ("task-on-the-specs-ssh-port", "ssh: {port: 2301}\n" + BASE,
     "8: jobs.worker: worker:1 uses port 2301 of a, its `ssh.port`, where tfcluster reaches the host: its "
     "TF server could not listen there"),
    ("env-knob-server-import", BASE + "env: {TFCLUSTER_SERVER_IMPORT: fulll}\n",
     "8: env.TFCLUSTER_SERVER_IMPORT: must be lean or full, got 'fulll'"),
    ("env-knob-flush", BASE + "env: {TFCLUSTER_STDOUT_FLUSH: abc}\n",
     "8: env.TFCLUSTER_STDOUT_FLUSH: must be seconds (a number, 0 or more), got 'abc'"),
    ("env-knob-flush-negative", BASE + "env: {TFCLUSTER_STDOUT_FLUSH: '-1'}\n",
     "8: env.TFCLUSTER_STDOUT_FLUSH: must be seconds (a number, 0 or more), got '-1'"),
    ("env-knob-standby-import", BASE + "env: {TFCLUSTER_STANDBY_IMPORT: 'tensorflow keras'}\n",
     "8: env.TFCLUSTER_STANDBY_IMPORT: must be module names, comma-separated, got 'tensorflow keras'"),
]


def test_an_unquoted_ipv6_address_inside_braces_gets_the_quoting_as_its_hint(tmp_path):
    path = tmp_path / "v6.yaml"
    path.write_text("name: t\nhosts:\n  - {name: a, address: ::1}\n")
    bad = error(str(path))
    assert str(bad) == f"{path}:3: yaml: did not find expected node content (while parsing a flow node)"
    assert bad.hint == "quote an IPv6 address: address: '::1'"
    path.write_text("name: t\nhosts: [a\n")          # another syntax error: no such hint
    assert error(str(path)).hint is None


@pytest.mark.parametrize("line,expected", [
    ("  tensorboard: {workdir}/tb\n", "10: yaml: did not find expected key (while parsing a block mapping)"),
    ("  args: ['--model_dir', {workdir}/ckpt]\n",
     "10: yaml: did not find expected ',' or ']' (while parsing a flow sequence)"),
    ("  args:\n    - --model_dir\n    - {workdir}\n", "12: train.args[1]: must be a string, got a mapping"),
])
def test_a_placeholder_left_unquoted_gets_the_quoting_as_its_hint(tmp_path, line, expected):
    """`{workdir}` that starts a YAML value is a mapping: YAML's own error, or a mapping where a
    string belongs, with the quoting as the hint."""
    path = write(tmp_path, BASE + "train:\n  script: template:between_graph\n" + line)
    bad = error(path)
    assert str(bad) == f"{path}:{expected}"
    assert bad.hint == "quote a value with a placeholder: YAML reads a bare {...} as a mapping: '{workdir}/tb'"
    # a mapping that is no placeholder: no such hint
    other = write(tmp_path, BASE + "train:\n  script: template:between_graph\n  args: [{a: 1}]\n", "o.yaml")
    assert error(other).hint is None


@pytest.mark.parametrize("text,expected", [c[1:] for c in REJECTIONS], ids=[c[0] for c in REJECTIONS])
def test_rejects_with_exact_message(tmp_path, text, expected):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(text)
    names = ", ".join(templates.template_names())
    want = f"{path}:" + expected.replace("{dir}", str(tmp_path)).replace("{templates}", names)
    assert str(error(str(path))) == want


def test_rejects_unreadable_inputs_without_a_line(tmp_path):
    assert str(error(str(tmp_path))) == f"{tmp_path}: not a regular file"
    assert str(error(str(tmp_path / "nope.yaml"))) == f"{tmp_path}/nope.yaml: cannot read spec: No such file or directory"


def test_rejects_non_utf8_at_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: t\nx: \xff\xfe\n")
    assert str(error(str(path))) == f"{path}:2: spec: not UTF-8 text (byte 0xff)"


def test_rejects_binary_garbage(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    message = str(error(str(path)))
    assert message.startswith(f"{path}:") and len(message.splitlines()) == 1


def test_rejects_a_5mb_spec_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BASE + "# " + "x" * (5 << 20) + "\n")
    assert str(error(str(path))) == f"{path}: file is {path.stat().st_size} bytes; a spec may be at most 1 MiB"


def test_rejects_billion_laughs_at_the_first_anchor(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(9)]
    path = write(tmp_path, "\n".join(lines) + "\n")
    assert str(error(path)) == f"{path}:1: yaml: YAML anchors/aliases are not supported"


def test_alias_without_anchor_is_a_yaml_error(tmp_path):
    path = write(tmp_path, BASE + "env: *nope\n")
    assert str(error(path)) == f"{path}:8: yaml: YAML anchors/aliases are not supported"


def test_error_messages_stay_on_one_line(tmp_path):
    path = write(tmp_path, BASE + '"bad\\nkey\\u2028": 1\n')
    assert str(error(path)) == f"{path}:8: bad\\nkey\\u2028: unknown key 'bad\\nkey\\u2028'; expected one of: " \
                               "name, python, workdir, env, secret_env, public_env, ssh, hosts, jobs, train, tf_ports"


def test_errors_carry_hints(tmp_path):
    path = write(tmp_path, BASE + "train: {mode: coordinator}\n")
    assert error(path).hint == "add chief: {count: 1, hosts: [...], port: ...}"
    path = write(tmp_path, BASE + "env: {A: [1]}\n")
    assert error(path).hint == 'quote it: A: "..."'


# ------------------------------------------------------------------ files a run ships

# (id, yaml text, "LINE: field: problem" after "FILE:"): load_spec accepts these, check_train_files refuses
MISSING_FILES = [
    ("script-missing", BASE + "train: {script: nope.py}\n", "8: train.script: file not found: {dir}/nope.py"),
    ("script-dir", BASE + "train: {script: sub}\n", "8: train.script: is a directory, not a file: {dir}/sub"),
    ("script-as-written", BASE + "train: {script: sub/../nope.py}\n",
     "8: train.script: file not found: {dir}/sub/../nope.py"),
    ("files-missing", BASE + "train:\n  files:\n    - sub\n    - gone.csv\n", "11: train.files[1]: not found: {dir}/gone.csv"),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in MISSING_FILES], ids=[c[0] for c in MISSING_FILES])
def test_check_train_files_rejects_with_exact_message(tmp_path, text, expected):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(text)
    spec = load_spec(str(path))
    with pytest.raises(SpecError) as info:
        check_train_files(spec)
    assert str(info.value) == f"{path}:" + expected.replace("{dir}", str(tmp_path))
    assert info.value.hint.endswith("are relative to the spec's directory")


def test_load_spec_accepts_a_script_and_files_that_do_not_exist(tmp_path):
    path = write(tmp_path, BASE + "train:\n  script: gone.py\n  files: [data.csv]\n")
    train = load_spec(path).train
    assert train.script == str(tmp_path / "gone.py") and train.files == ("data.csv",)
    (tmp_path / "gone.py").write_text("")
    (tmp_path / "data.csv").write_text("")
    check_train_files(load_spec(path))


def test_check_train_files_skips_templates_and_command_line_scripts(tmp_path, monkeypatch):
    monkeypatch.setattr(templates, "templates_root", lambda: tmp_path / "tpl")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "mirrored.py").write_text("# template\n")
    check_train_files(load_spec(write(tmp_path, BASE + "train: {script: 'template:mirrored'}\n")))
    (tmp_path / "mine.py").write_text("")
    spec = load_spec(write(tmp_path, BASE + "train: {script: moved.py}\n"))
    check_train_files(with_train_overrides(spec, script=str(tmp_path / "mine.py")))


# ------------------------------------------------------------------ command-line overrides

def usage_error(spec: Spec, **overrides) -> UsageError:
    with pytest.raises(UsageError) as info:
        with_train_overrides(spec, **overrides)
    return info.value


def test_overrides_nothing_returns_the_same_spec(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "train: {args: [a], timeout: 5}\n"))
    assert with_train_overrides(spec) is spec
    assert with_train_overrides(spec, args=[]) is spec


def test_override_script_must_exist_and_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write(tmp_path, BASE + "train: {script: old.py}\n"))
    assert str(usage_error(spec, script="nope.py")) == "--script: no such file: nope.py"
    (tmp_path / "new.py").write_text("")
    train = with_train_overrides(spec, script="new.py").train
    assert train.script == str(tmp_path / "new.py")
    assert train.script_source is None and train.script_line == 0


def test_override_args_use_the_loaders_placeholder_rules(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    known = "job, index, ps_hosts, worker_hosts, chief_hosts, workdir, num_workers"
    bad = usage_error(spec, args=["--i", "{index:>3}"])
    assert str(bad) == f"script argument 2 ('{{index:>3}}'): unknown placeholder {{index:>3}}; known: {known}"
    assert bad.hint == "write {{ and }} for literal braces"
    assert str(usage_error(spec, args=["{steps}"])) == \
        f"script argument 1 ('{{steps}}'): unknown placeholder {{steps}}; known: {known}"
    assert str(usage_error(spec, args=["x}"])) == ("script argument 1 ('x}'): malformed placeholder in 'x}' "
                                                   "(Single '}' encountered in format string); "
                                                   "write {{ and }} for literal braces")
    train = with_train_overrides(spec, args=["--i", "{index}", "{{x}}"]).train
    assert train.args == ("--i", "{index}", "{{x}}") and train.args_line == 0


def test_override_timeout_must_be_positive(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    for bad in (0, -1.5, float("nan"), float("inf")):
        assert str(usage_error(spec, timeout=bad)) == "--timeout must be a positive number of seconds"
    assert with_train_overrides(spec, timeout=90).train.timeout == 90.0


# ------------------------------------------------------------------ valid specs

FULL = """\
name: lab
python: /opt/venv/bin/python
workdir: ~/.tfcluster
env: {TF_CPP_MIN_LOG_LEVEL: "2", DEBUG: no, N: 2}
ssh:
  user: ubuntu
  port: 22
  identity_file: ~/.ssh/id_ed25519
  known_hosts: ~/.ssh/known_hosts
  host_key_policy: reject
  jump_host: bastion.example
  connect_timeout: 1m
hosts:
  - {name: cpu0, address: 10.1.0.10}
  - {name: gpu0, address: 10.1.0.11, gpus: 4}
  - {name: gpu1, address: 10.1.0.12, gpus: 4, ssh: {user: admin, connect_timeout: 2.5}}
  - {name: me, address: localhost}
  - {name: me6, address: "::1", ssh: {host_key_policy: accept-new}}
jobs:
  worker: {per_gpu: true, hosts: [gpu0, gpu1], port: 2300}
  ps:     {count: 2, hosts: [cpu0], port: 2222}
train:
  mode: between-graph
  script: train.py
  files: [model/, data/small.csv]
  args: ["--steps", 2000, "--model_dir", "{workdir}/ckpt", "{{literal}}", no]
  restart: {policy: on-failure, max_restarts: 3}
  timeout: 30m
"""


def test_full_spec_loads_to_the_exact_spec(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "small.csv").write_text("1\n")
    path = write(tmp_path, FULL, "lab.yaml")
    base = SshSettings(user="ubuntu", port=22, identity_file="~/.ssh/id_ed25519",
                       known_hosts="~/.ssh/known_hosts", host_key_policy="reject",
                       jump_host="bastion.example", connect_timeout=60.0)
    assert load_spec(path) == Spec(
        path=path, name="lab", python="/opt/venv/bin/python", workdir="~/.tfcluster",
        env=(("TF_CPP_MIN_LOG_LEVEL", "2"), ("DEBUG", "no"), ("N", "2")),
        hosts=(
            Host("cpu0", "10.1.0.10", 0, False, base, 14),
            Host("gpu0", "10.1.0.11", 4, False, base, 15, gpus_set=True),
            Host("gpu1", "10.1.0.12", 4, False,
                 SshSettings(**{**vars(base), "user": "admin", "connect_timeout": 2.5}), 16, gpus_set=True),
            Host("me", "localhost", 0, True, base, 17),
            Host("me6", "::1", 0, False, SshSettings(**{**vars(base), "host_key_policy": "accept-new"}), 18),
        ),
        jobs=(Job("ps", count=2, hosts=("cpu0",), port=2222, line=21),
              Job("worker", per_gpu=True, gpus=1, hosts=("gpu0", "gpu1"), port=2300, line=20)),
        train=Train(mode="between-graph", script=str(tmp_path / "train.py"),
                    files=("model/", "data/small.csv"),
                    args=("--steps", "2000", "--model_dir", "{workdir}/ckpt", "{{literal}}", "no"),
                    restart=Restart("on-failure", 3), timeout=1800.0, args_line=26, args_lines=(26,) * 6,
                    script_source="train.py", script_line=24, files_lines=(25, 25)),
        digest=hashlib.sha256(Path(path).read_bytes()).hexdigest(),
    )


def test_minimal_spec_gets_defaults(tmp_path):
    path = write(tmp_path, "name: m\nhosts: [{name: l, address: 127.0.0.1}]\njobs:\n"
                           "  ps: {tasks: ['l:2222']}\n  worker: {tasks: ['l:2223']}\n")
    spec = load_spec(path)
    assert spec.python == "python3" and spec.workdir == "~/.tfcluster" and spec.env == ()
    assert spec.hosts == (Host("l", "127.0.0.1", 0, True, SshSettings(), 2),)
    assert spec.train == Train()
    assert spec.jobs == (Job("ps", tasks=(("l", 2222),), line=4), Job("worker", tasks=(("l", 2223),), line=5))


@pytest.mark.parametrize("text,seconds", [("90", 90.0), ("1.5", 1.5), ("90s", 90.0), ("30m", 1800.0),
                                          ("2h", 7200.0), ('"45s"', 45.0)])
def test_timeout_accepts_seconds_and_durations(tmp_path, text, seconds):
    path = write(tmp_path, BASE + f"train: {{timeout: {text}}}\n")
    assert load_spec(path).train.timeout == seconds


def test_stop_grace_defaults_to_10s_and_reaches_the_plan(tmp_path):
    assert load_spec(write(tmp_path, BASE)).train.stop_grace == 10.0
    spec = load_spec(write(tmp_path, BASE + "train: {stop_grace: 45s}\n"))
    assert spec.train.stop_grace == 45.0 and build_plan(spec).stop_grace == 45.0


def test_template_script_resolves_in_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(templates, "templates_root", lambda: tmp_path / "tpl")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "mirrored.py").write_text("# template\n")
    path = write(tmp_path, BASE + "train: {script: 'template:mirrored'}\n")
    assert load_spec(path).train.script == str(tmp_path / "tpl" / "mirrored.py")
    path = write(tmp_path, BASE + "train: {script: 'template:mirored'}\n")
    assert str(error(path)) == f"{path}:8: train.script: unknown template 'mirored'; did you mean 'mirrored'?"


def test_shipped_template_resolves(tmp_path):
    names = templates.template_names()
    assert names == ["between_graph", "classic", "coordinator", "keras_jax", "mirrored"]
    path = write(tmp_path, BASE + f"train: {{script: 'template:{names[0]}'}}\n")
    script = load_spec(path).train.script
    assert script.endswith(f"{names[0]}.py") and os.path.isfile(script)


# ------------------------------------------------------------------ layout

def test_layout_count_jobs_go_round_robin_with_ports_counting_up(tmp_path):
    path = write(tmp_path, "name: t\nhosts:\n  - {name: a, address: a.example}\n  - {name: b, address: b.example}\n"
                           "jobs:\n  ps: {count: 3, hosts: [a, b], port: 2222}\n"
                           "  worker: {count: 5, hosts: [b, a], port: 2300}\n")
    assert layout_tasks(load_spec(path)) == (
        Slot("ps", 0, "a", 2222, ()), Slot("ps", 1, "b", 2222, ()), Slot("ps", 2, "a", 2223, ()),
        Slot("worker", 0, "b", 2300, ()), Slot("worker", 1, "a", 2300, ()), Slot("worker", 2, "b", 2301, ()),
        Slot("worker", 3, "a", 2301, ()), Slot("worker", 4, "b", 2302, ()),
    )


def test_layout_per_gpu_gives_each_gpu_one_task(tmp_path):
    path = write(tmp_path, "name: t\nhosts:\n  - {name: c, address: 10.0.0.9}\n"
                           "  - {name: g0, address: 10.0.0.1, gpus: 4}\n  - {name: g1, address: 10.0.0.2, gpus: 4}\n"
                           "jobs:\n  ps: {count: 1, hosts: [c], port: 2222}\n"
                           "  worker: {per_gpu: true, hosts: [g0, g1], port: 2300}\n")
    assert layout_tasks(load_spec(path)) == (
        Slot("ps", 0, "c", 2222, ()),
        *(Slot("worker", i, "g0", 2300 + i, (i,)) for i in range(4)),
        *(Slot("worker", 4 + i, "g1", 2300 + i, (i,)) for i in range(4)),
    )


def test_layout_explicit_tasks_keep_list_order(tmp_path):
    path = write(tmp_path, "name: t\nhosts:\n  - {name: a, address: 127.0.0.2}\n  - {name: b, address: 127.0.0.3}\n"
                           "jobs:\n  ps: {tasks: ['b:2222', 'a:2223']}\n  worker: {tasks: ['a:2300', 'b:2301', 'a:2302']}\n")
    assert layout_tasks(load_spec(path)) == (
        Slot("ps", 0, "b", 2222), Slot("ps", 1, "a", 2223),
        Slot("worker", 0, "a", 2300), Slot("worker", 1, "b", 2301), Slot("worker", 2, "a", 2302),
    )


def test_layout_gpu_ids_follow_job_order_then_index(tmp_path):
    path = write(tmp_path, "name: t\nhosts:\n  - {name: c, address: 10.0.0.9}\n  - {name: g, address: 10.0.0.1, gpus: 8}\n"
                           "jobs:\n  evaluator: {count: 1, hosts: [g], port: 2400, gpus: 1}\n"
                           "  worker: {tasks: ['g:2300', 'g:2301'], gpus: 2}\n"
                           "  ps: {count: 1, hosts: [c], port: 2222}\n"
                           "  chief: {count: 1, hosts: [g], port: 2200, gpus: 3}\n")
    assert layout_tasks(load_spec(path)) == (
        Slot("chief", 0, "g", 2200, (0, 1, 2)), Slot("ps", 0, "c", 2222, ()),
        Slot("worker", 0, "g", 2300, (3, 4)), Slot("worker", 1, "g", 2301, (5, 6)),
        Slot("evaluator", 0, "g", 2400, (7,)),
    )


def test_layout_ignores_job_key_order_and_host_list_order(tmp_path):
    one = write(tmp_path, "name: t\nhosts:\n  - {name: a, address: 10.0.0.1, gpus: 2}\n  - {name: b, address: 10.0.0.2}\n"
                          "jobs:\n  ps: {count: 2, hosts: [b], port: 2222}\n  worker: {per_gpu: true, hosts: [a], port: 2300}\n",
                "one.yaml")
    two = write(tmp_path, "name: t\nhosts:\n  - {name: b, address: 10.0.0.2}\n  - {name: a, address: 10.0.0.1, gpus: 2}\n"
                          "jobs:\n  worker: {per_gpu: true, hosts: [a], port: 2300}\n  ps: {count: 2, hosts: [b], port: 2222}\n",
                "two.yaml")
    first, second = load_spec(one), load_spec(two)
    assert [j.name for j in second.jobs] == ["ps", "worker"]
    assert layout_tasks(first) == layout_tasks(second)


def test_a_thousand_task_spec_loads(tmp_path):
    hosts = "".join(f"  - {{name: h{i}, address: 10.0.{i // 250}.{i % 250 + 1}}}\n" for i in range(100))
    tasks = "".join(f"      - h{i % 100}:{3000 + i // 100}\n" for i in range(1000))
    path = write(tmp_path, "name: big\nhosts:\n" + hosts + "jobs:\n  ps: {count: 1, hosts: [h0], port: 2222}\n"
                           "  worker:\n    tasks:\n" + tasks)
    assert len(layout_tasks(load_spec(path))) == 1001


# ------------------------------------------------------------------ never crashes

SEEDS = [FULL, BASE + "train:\n  args: ['--x', '{job}']\n  restart: {policy: never}\n",
         "name: m\nhosts: [{name: l, address: 127.0.0.1}]\njobs:\n  ps: {tasks: ['l:2222']}\n"
         "  worker: {tasks: ['l:2223']}\nenv:\n  A: b\n"]
TOKENS = [": ", "- ", "&a ", "*a", "{", "}", "[", "]", "\t", "é", "\u2028", "\0", "99999999999999999999999",
          "1e999", "0x10", "22:22", "~", "null", "!!python/object", "? ", "|", ">", "'", '"', "#", "---", "...",
          "%YAML 1.1", "\\", "\r", "\ufeff", "{{", "}}", "{steps}", "per_gpu: true", "gpus: 9999", "\n  ", ","]


@st.composite
def mutated(draw) -> str:
    lines = draw(st.sampled_from(SEEDS)).split("\n")
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "duplicate", "replace", "swap", "insert"]))
        i = draw(st.integers(0, len(lines) - 1))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "replace":
            lines[i] = draw(st.text(max_size=20))
        elif op == "swap" and len(lines[i]) > 1:
            j = draw(st.integers(0, len(lines[i]) - 2))
            s = lines[i]
            lines[i] = s[:j] + s[j + 1] + s[j] + s[j + 2:]
        else:
            j = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:j] + draw(st.sampled_from(TOKENS)) + lines[i][j:]
    return "\n".join(lines)


_FUZZ_IDS = itertools.count()


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Iterator[Path]:
    # thousands of tiny files: memory-backed /dev/shm keeps the property test near 10 s
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="tfcluster-spec-", dir=shm or tmp_path_factory.getbasetemp()))
    (directory / "train.py").write_text("")
    (directory / "model").mkdir()
    (directory / "data").mkdir()
    (directory / "data" / "small.csv").write_text("")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=mutated())
def test_mutated_specs_load_or_fail_with_one_line_spec_error(fuzz_dir, text):
    path = fuzz_dir / f"c{next(_FUZZ_IDS)}.yaml"   # a fresh file: rewriting one is ~10x slower here
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        spec = load_spec(str(path))
    except SpecError as exc:
        assert str(exc).startswith(f"{path}:") and len(str(exc).splitlines()) == 1, str(exc)
    else:
        assert isinstance(spec, Spec)
        layout_tasks(spec)
        try:
            check_train_files(spec)
        except SpecError as exc:
            assert str(exc).startswith(f"{path}:") and len(str(exc).splitlines()) == 1, str(exc)


@pytest.mark.parametrize("text,expected", [("", "auto"), ("train: {keras: auto}\n", "auto"),
                                           ("train: {keras: legacy}\n", "legacy")])
def test_train_keras_is_auto_unless_legacy_is_asked(tmp_path, text, expected):
    spec = load_spec(write(tmp_path, BASE + text))
    assert spec.train.keras == expected and spec.train.keras_line == (8 if text else 0)


def test_train_keras_legacy_agrees_with_an_env_that_sets_it_as_tensorflow_reads_it(tmp_path):
    text = BASE.replace("jobs:", "env: {TF_USE_LEGACY_KERAS: 'True'}\njobs:") + "train: {keras: legacy}\n"
    assert load_spec(write(tmp_path, text)).train.keras == "legacy"
