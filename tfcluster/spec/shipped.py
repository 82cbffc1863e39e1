"""What a run ships: train.script and train.files resolved, checked and listed before
anything connects (docs/design/spec-safety.md, "Spec safety").

A path from the spec must resolve (symbolic links followed) inside the spec's directory
or a `train.allow_outside` directory; a template script ships from the package and a
`--script` from the command line is the user's own choice, so neither is held to that.
Only regular files and directories: a directory is walked without following links, and a
link inside it is held to the same rule. Sizes come from stat, capped, before a byte is
read. The result is the plan's file list: (local path, path in the run dir, bytes).
"""
from __future__ import annotations

import ast
import os
import re
import stat
from dataclasses import dataclass

from tfcluster.spec.model import MAX_SHIP_BYTES, MAX_SHIP_FILES, Spec
from tfcluster.spec.yamltree import BadValue, sub_field

Shipped = tuple[tuple[str, str, int], ...]

_OUTSIDE_HINT = ("list its directory in train.allow_outside to ship from there, or keep the "
                 "files next to the spec")
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class _Files:
    """The files found so far, checked against each other and the limits."""

    def __init__(self, spec: Spec) -> None:
        self.base = os.path.realpath(spec.base_dir)
        self.roots = [self.base] + [_allowed(spec, i) for i in range(len(spec.train.allow_outside))]
        self.out: list[tuple[str, str, int]] = []
        self.dests: dict[str, str] = {}
        self.dirs: set[str] = set()
        self.total = self.entries = 0

    def inside(self, real: str) -> bool:
        return any(os.path.commonpath([root, real]) == root for root in self.roots)

    def resolve(self, path: str, line: int, field: str) -> str:
        path, real = os.path.normpath(path), os.path.realpath(path)
        if not self.inside(real):
            where = "the spec's directory" + (" and train.allow_outside" if len(self.roots) > 1 else "")
            shown = f"{path} is" if real == path else f"{path} resolves to {real},"
            raise BadValue(line, field, f"{shown} outside {where} ({self.base})", hint=_OUTSIDE_HINT)
        return real

    def count(self, line: int, field: str, path: str) -> None:
        self.entries += 1
        if self.entries > MAX_SHIP_FILES:
            raise BadValue(line, field, f"more than {MAX_SHIP_FILES} files and directories to ship "
                                    f"(at {path})", hint="put data on the hosts instead")

    def add(self, real: str, dest: str, size: int, line: int, field: str) -> None:
        self.count(line, field, real)
        if not os.access(real, os.R_OK):
            raise BadValue(line, field, f"cannot read {real}: permission denied")
        if dest in self.dests:
            if self.dests[dest] == real:     # listed twice (a directory and a file in it)
                return
            raise BadValue(line, field, f"{real} and {self.dests[dest]} would both be {dest} in the "
                                    "run directory")
        parents = [os.path.dirname(dest)]
        while parents[-1]:
            parents.append(os.path.dirname(parents[-1]))
        clash = dest if dest in self.dirs else next((p for p in parents if p in self.dests), None)
        if clash:
            raise BadValue(line, field, f"{clash} would be both a file and a directory in the run directory")
        if size > MAX_SHIP_BYTES or self.total + size > MAX_SHIP_BYTES:
            raise BadValue(line, field, f"{real} is {size} bytes and brings what a run ships to "
                                    f"{self.total + size}; at most {MAX_SHIP_BYTES} (256 MiB)",
                       hint="put data on the hosts instead")
        self.total += size
        self.dests[dest] = real
        self.dirs.update(parents[:-1])
        self.out.append((real, dest, size))

    def walk(self, top: str, dest: str, line: int, field: str) -> None:
        def refuse(exc: OSError) -> None:
            raise BadValue(line, field, f"cannot read {exc.filename}: {exc.strerror}")

        for root, dirs, names in os.walk(top, onerror=refuse):
            dirs.sort()
            for name in dirs:
                path = os.path.join(root, name)
                self.count(line, field, path)
                if os.path.islink(path):
                    self.resolve(path, line, field)
                    raise BadValue(line, field, f"{path} is a symbolic link to a directory, which is "
                                            "not followed", hint="list its target in train.files")
            for name in sorted(names):
                path = os.path.join(root, name)
                real = self.resolve(path, line, field)
                st = _stat(real, line, field)
                if not stat.S_ISREG(st.st_mode):
                    raise BadValue(line, field, f"{path} is {kind_of(st.st_mode)}; only regular files and "
                                            "directories are shipped")
                self.add(real, os.path.normpath(os.path.join(dest, os.path.relpath(path, top))),
                         st.st_size, line, field)


def _stat(path: str, line: int, field: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise BadValue(line, field, f"cannot read {path}: {exc.strerror}") from None


def _allowed(spec: Spec, i: int) -> str:
    train = spec.train
    full = os.path.join(spec.base_dir, train.allow_outside[i])
    if not os.path.isdir(full):
        raise BadValue(train.allow_outside_lines[i], sub_field("train.allow_outside", i), f"not a directory: {full}")
    return os.path.realpath(full)


def _dest(base: str, full: str) -> str:
    """Where an entry lands in the run directory: its path relative to the spec's directory
    as written (a link keeps its own name); an entry from elsewhere, under its own name."""
    path = os.path.normpath(full)
    if os.path.commonpath([base, path]) == base:
        return os.path.relpath(path, base)
    return os.path.basename(path)


def script_dest(spec: Spec) -> str:
    """Where train.script lands in the run directory, and so what each task runs there: as
    every shipped file, its path relative to the spec's directory (`tutorial/main.py` runs
    with `tutorial/` first on sys.path, as `python tutorial/main.py` does here, so the modules
    shipped beside it import); a template, a `--script` or an `allow_outside` script under
    its own name."""
    source = spec.train.script_source
    if source is None or source.startswith("template:"):
        return os.path.basename(spec.train.script)
    base = os.path.abspath(spec.base_dir)
    return _dest(base, os.path.join(base, source))


def ship_list(spec: Spec) -> Shipped:
    """Every file a run ships, script first: (realpath, path in the run dir, bytes)."""
    train, files = spec.train, _Files(spec)
    base = os.path.abspath(spec.base_dir)
    source = train.script_source
    if train.script:
        own = source is not None and not source.startswith("template:")
        full = os.path.join(base, source) if own else train.script
        if not os.path.isfile(full):
            what = "is a directory, not a file" if os.path.isdir(full) else "file not found"
            raise BadValue(train.script_line, "train.script", f"{what}: {full}",
                       hint="script paths are relative to the spec's directory")
        real = files.resolve(full, train.script_line, "train.script") if own else os.path.realpath(full)
        files.add(real, script_dest(spec), os.stat(real).st_size, train.script_line, "train.script")
    for i, (value, line) in enumerate(zip(train.files, train.files_lines)):
        field, full = sub_field("train.files", i), os.path.join(base, value)
        if not os.path.exists(full):
            raise BadValue(line, field, f"not found: {full}", hint="file paths are relative to the spec's directory")
        real = files.resolve(full, line, field)
        st, dest = _stat(real, line, field), _dest(base, full)
        if stat.S_ISDIR(st.st_mode):
            files.walk(real, "" if dest == "." else dest, line, field)
        elif stat.S_ISREG(st.st_mode):
            files.add(real, dest, st.st_size, line, field)
        else:
            raise BadValue(line, field, f"{full} is {kind_of(st.st_mode)}; only regular files and "
                                    "directories are shipped")
    return tuple(files.out)


SCAN_BYTES = 4 << 20      # of each file read by scan_scripts: a script, not a data file
SCAN_FILES = 200          # Python files read, the script first
_FIT_CALL = re.compile(rb"\.fit\s*\(")
_STRATEGY = re.compile(rb"MultiWorkerMirroredStrategy|ParameterServerStrategy")
# a strategy built: its class, called (`\b`: MultiWorkerMirroredStrategy is not MirroredStrategy)
_BUILT = re.compile(rb"\b(MultiWorkerMirroredStrategy|MirroredStrategy|OneDeviceStrategy|CentralStorageStrategy|"
                    rb"ParameterServerStrategy(?:V2)?|TPUStrategy)\s*\(")
# Keras 2 names that Keras 3 (tf.keras from TF 2.16) does not have: what each line would raise
_KERAS2_ONLY = ((re.compile(rb"\boptimizers\.legacy\b"), "tf.keras.optimizers.legacy (Keras 3 has none)"),
                (re.compile(rb"\.reset_states\s*\("), "reset_states() (Keras 3's metrics have reset_state())"))
_TF_OP = re.compile(r"tf\.[\w.]+")
# a JAX process joining the others: keras.distribution.initialize(), jax.distributed.initialize()
# (or either imported by name)
_JOINS = re.compile(rb"\bdistribut(?:ion|ed)\.initialize\s*\(|\bimport\b[^\n]*\binitialize\b")
_OWN_SERVER = re.compile(rb"\.Server\s*\(")      # tf.distribute.Server(...), tf.train.Server(...)
# TF_CONFIG set by the script (TensorFlow's tutorials do, for a run by hand on localhost):
# `environ["TF_CONFIG"] = ...`, `environ.update({"TF_CONFIG": ...})`, `putenv("TF_CONFIG", ...)`
_SETS_TF_CONFIG = re.compile(rb"""environ\s*\[\s*['"]TF_CONFIG['"]\s*\]\s*=(?!=)|"""
                             rb"""environ\.update\([^)\n]*['"]TF_CONFIG['"]|putenv\(\s*['"]TF_CONFIG['"]""")


@dataclass(frozen=True)
class ScriptScan:
    """What the text of train.script and the Python files it ships says, read, never run:
    where each is FILE:LINE, FILE as it lands in the run directory. A comment or a string
    counts too, so what this feeds is a warning, never a refusal (docs/modes.md, "Keras")."""

    fits: bool = False         # a `.fit(` call and a multi-worker strategy named, in any file
    fit_at: str | None = None  # where the first `.fit(` is
    strategies: tuple[tuple[str, str], ...] = ()    # (class, where) of each strategy built
    keras2_only: tuple[tuple[str, str], ...] = ()   # (what fails under Keras 3, where)
    joins: bool = False        # a JAX process joining the others, in any file
    sets_tf_config: str | None = None   # where the script sets TF_CONFIG itself, if it does
    own_server: bool = False   # it builds a TF server of its own (an old-style trainer)
    # (module, the file beside the script or the spec it would be, where it is imported) for
    # each module a shipped file imports that sits here but is not shipped: on the hosts the
    # import fails (the tutorials' `import mnist_setup`)
    unshipped: tuple[tuple[str, str, str], ...] = ()
    base: str = ""             # the spec's directory, which train.files entries are relative to

    def entry(self, path: str) -> str:
        """The train.files entry that ships `path`, a module's file or package found here."""
        inside = self.base and os.path.commonpath([self.base, path]) == self.base
        return os.path.relpath(path, self.base) if inside else os.path.basename(path)

    def unshipped_line(self) -> str | None:
        """The warning for `unshipped`, or None."""
        if not self.unshipped:
            return None
        shown = "; ".join(f"{where} imports {module} ({path})" for module, path, where in self.unshipped[:3])
        more = f" (and {len(self.unshipped) - 3} more)" if len(self.unshipped) > 3 else ""
        listed = ", ".join(dict.fromkeys(self.entry(p) for _, p, _ in self.unshipped))
        return (f"{shown}{more}, which train.files does not ship: a host imports it only where it is "
                f"installed; to ship it, add it to train.files (files: [{listed}])")


def scan_scripts(spec: Spec) -> ScriptScan | None:
    """train.script and the `.py` files of train.files, each from its first SCAN_BYTES; None
    without a script or when it cannot be read (check_train_files reports that). The files
    are the ones a run ships (none but the script when the list is refused: train says why)."""
    if not spec.train.script:
        return None
    try:
        with open(spec.train.script, "rb") as f:
            texts = [(script_dest(spec), f.read(SCAN_BYTES))]
    except OSError:
        return None
    try:
        shipped = ship_list(spec)
    except BadValue:
        shipped = ()
    helpers = [(real, dest) for real, dest, _ in shipped[1:] if dest.endswith(".py")]
    for real, dest in helpers[:SCAN_FILES - 1]:
        try:
            with open(real, "rb") as f:
                texts.append((dest, f.read(SCAN_BYTES)))
        except OSError:
            continue
    fit_at, strategies, keras2, sets_tf_config = None, [], [], None
    named = joins = own_server = False
    for name, text in texts:
        named = named or _STRATEGY.search(text) is not None
        for number, line in enumerate(text.split(b"\n"), 1):
            code = line.split(b"#", 1)[0]
            if fit_at is None and _FIT_CALL.search(line):
                fit_at = f"{name}:{number}"
            strategies += [(m.group(1).decode(), f"{name}:{number}") for m in _BUILT.finditer(code)]
            keras2 += [(what, f"{name}:{number}") for regex, what in _KERAS2_ONLY if regex.search(code)]
            joins = joins or _JOINS.search(code) is not None
            own_server = own_server or _OWN_SERVER.search(code) is not None
            if sets_tf_config is None and _SETS_TF_CONFIG.search(code):
                sets_tf_config = f"{name}:{number}"
        keras2 += [(what, f"{name}:{number}") for what, number in tf_ops_on_keras_inputs(text)]
    unshipped = _unshipped(spec, texts, {dest for _, dest, _ in shipped}) if shipped else ()
    return ScriptScan(fits=fit_at is not None and named, fit_at=fit_at, strategies=tuple(strategies),
                      keras2_only=tuple(sorted(keras2, key=lambda k: _where_key(k[1]))), joins=joins,
                      unshipped=unshipped, base=os.path.realpath(spec.base_dir), sets_tf_config=sets_tf_config,
                      own_server=own_server)


def _unshipped(spec: Spec, texts: list[tuple[str, bytes]], dests: set[str]) -> tuple[tuple[str, str, str], ...]:
    """The modules the shipped Python files import by a top-level name that is a file or a
    package here, beside the script or the spec, and is not in the run directory: the script
    runs there, its directory first on sys.path, so only what is shipped there imports."""
    own = spec.train.script_source is not None and not spec.train.script_source.startswith("template:")
    if not own:
        return ()
    places = list(dict.fromkeys([os.path.dirname(os.path.realpath(spec.train.script)),
                                 os.path.realpath(spec.base_dir)]))
    first = os.path.dirname(script_dest(spec))      # sys.path[0] there, under the run directory
    found: dict[str, tuple[str, str, str]] = {}
    for name, text in texts:
        for module, number in _imports(text):
            at = os.path.join(first, module)
            if module in found or f"{at}.py" in dests or f"{at}/__init__.py" in dests:
                continue
            for place in places:
                path = next((p for p in (os.path.join(place, f"{module}.py"), os.path.join(place, module))
                             if os.path.isfile(p) or os.path.isfile(os.path.join(p, "__init__.py"))), None)
                if path is not None:
                    found[module] = (module, path, f"{name}:{number}")
                    break
    return tuple(found.values())


def _imports(text: bytes) -> list[tuple[str, int]]:
    """(top-level module, line) of each absolute import in a file; none when it does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], node.lineno))
    return sorted(out, key=lambda m: m[1])


def _where_key(where: str) -> tuple[str, int]:
    name, _, number = where.rpartition(":")
    return name, int(number)


def tf_ops_on_keras_inputs(text: bytes) -> list[tuple[str, int]]:
    """(what, line) of each TensorFlow function called on a Keras model input, in the same
    function (or module) body: `x = tf.keras.Input(...)` then `tf.reduce_mean(layer(x))`.
    Keras 2 made such a call a layer of the model; Keras 3 raises "A KerasTensor cannot be
    used as input to a TensorFlow function". Inputs are followed through assignments from
    calls that are not TensorFlow's own (layers); a file that does not parse has none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found: list[tuple[str, int]] = []
    bodies = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for body in bodies:
        symbolic: set[str] = set()
        for node in _own_statements(body.body):
            if isinstance(node, ast.Assign):
                value = node.value
                if isinstance(value, ast.Call) and (_called(value).endswith("Input") or
                                                    (not _is_tf(value) and _mentions(value, symbolic))):
                    symbolic |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for call in (n for n in _own_nodes(node) if isinstance(n, ast.Call)):
                if _is_tf(call) and not _called(call).startswith("tf.keras") and \
                        any(_mentions(a, symbolic) for a in [*call.args, *(k.value for k in call.keywords)]):
                    found.append((f"{_called(call)} on a Keras input (Keras 3: \"A KerasTensor cannot be "
                                  f"used as input to a TensorFlow function\")", call.lineno))
    return found


_BLOCKS = (ast.With, ast.AsyncWith, ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try)


def _own_statements(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module or function body, `with`, `if`, loop and `try` blocks
    included, nested functions and classes left out (their names are their own), in order."""
    out: list[ast.stmt] = []
    for stmt in stmts:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        out.append(stmt)
        if isinstance(stmt, _BLOCKS):
            for block in (stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", []),
                          *[h.body for h in getattr(stmt, "handlers", [])]):
                out += _own_statements(block)
    return out


def _own_nodes(stmt: ast.stmt) -> list[ast.AST]:
    """The expressions of one statement, not those of the blocks it holds or of a lambda."""
    if isinstance(stmt, _BLOCKS):
        heads = [getattr(stmt, "test", None), getattr(stmt, "iter", None),
                 *[item.context_expr for item in getattr(stmt, "items", [])]]
        return [n for h in heads if h is not None for n in ast.walk(h)]
    return [n for n in ast.walk(stmt) if not isinstance(n, ast.Lambda)]


def _called(call: ast.Call) -> str:
    """`tf.math.reduce_mean` for a call of that name; "" for one of no plain dotted name."""
    parts, func = [], call.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    return ".".join([func.id, *reversed(parts)])


def _is_tf(call: ast.Call) -> bool:
    return _TF_OP.fullmatch(_called(call)) is not None


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return bool(names) and any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def script_calls_fit(spec: Spec) -> bool | None:
    """Whether train.script or a Python file it ships calls `.fit(` (Keras' model.fit, as far
    as text can tell) and one of them names a multi-worker strategy (a script without one
    trains alone, whatever the mode); None without a script or when it cannot be read
    (scan_scripts)."""
    scan = scan_scripts(spec)
    return None if scan is None else scan.fits
