"""Directories only this user can change, and files opened without following links.

The rule (sshd's StrictModes; docs/ARCHITECTURE.md, "Files and directories on a
host"): every level tfcluster creates is made 0700, one level at a time; every level
that exists, from / down, must be owned by this user or root and writable by nobody
else, except a sticky directory owned by root such as /tmp. A symbolic link is
followed only when this user or root owns it, and where it leads passes the same rule.

Shipped beside shim.py, and also the first part of the bootstrap program
(bootstrap.py), which checks the cluster tree before anything is shipped into it:
standard library only, nothing imported from the package, and no syntax an old Python cannot
parse (the bootstrap must still say "too old").
"""
import hashlib
import os
import stat

MAX_LINKS = 16
READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class Refused(ValueError):
    """A path someone else could change: one line naming it and the fix."""

    one_line = True


def expand(path):
    """`~` or `~/...` is the login user's home; nothing else is expanded."""
    return os.path.expanduser(path) if path == "~" or path.startswith("~/") else path


def _who(uid):
    try:
        import pwd
        return "%s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except (ImportError, KeyError):
        return "uid %d" % uid


def _judge(path, st):
    """Refuse a level that someone other than this user or root could change."""
    if st.st_uid not in (0, os.geteuid()):
        raise Refused("%s is owned by %s, not by you: refusing to use it "
                      "(remove it, or use a directory of your own)" % (path, _who(st.st_uid)))
    if stat.S_ISLNK(st.st_mode):
        return
    if not stat.S_ISDIR(st.st_mode):
        raise Refused("%s is not a directory" % path)
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise Refused("%s is writable by others (mode %04o): refusing to use it "
                      "(chmod go-w %s, or use a directory of your own)"
                      % (path, stat.S_IMODE(st.st_mode), path))


def _mkdir(path):
    """Create one level 0700 whatever the umask; False when it appeared meanwhile."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return True


def _mkdir_or_refuse(path):
    try:
        return _mkdir(path)
    except PermissionError:
        raise Refused("%s: permission denied (its directory is not yours to write): "
                      "use a directory of your own" % path) from None
    except OSError as e:        # a read-only or full filesystem, a place no directory can be
        raise Refused("%s: cannot make this directory: %s" % (path, e.strerror or e)) from None


def private_dir(path, top="/"):
    """Make `path` a directory that only this user (and root) can change; returns it
    absolute.

    Missing levels are created 0700. Existing levels are judged from `top` down (every
    level by default); levels above `top` are the caller's choice, created if missing."""
    if ".." in path.split("/"):
        raise Refused("%s: a tfcluster directory may not contain '..'" % path)
    path = os.path.abspath(expand(path))
    _walk(path, os.path.abspath(expand(top)), 0)
    return path


def _walk(path, top, links):
    """`top`: the first level to judge (None: judge none)."""
    cur = lexical = "/"
    judging = top == "/"
    if judging:
        _judge(cur, os.lstat(cur))
    for name in [p for p in path.split("/") if p]:
        cur, lexical = os.path.join(cur, name), os.path.join(lexical, name)
        judging = judging or lexical == top
        while True:
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                if _mkdir_or_refuse(cur):
                    break
                continue                 # created meanwhile: judge what is there
            except PermissionError:
                raise Refused("%s: permission denied (a directory above it is not yours to enter): "
                              "use a directory of your own" % cur) from None
            if judging:
                _judge(cur, st)
            if stat.S_ISLNK(st.st_mode):
                if links >= MAX_LINKS:
                    raise Refused("%s: too many levels of symbolic links" % path)
                # a link we trust may lead anywhere: where it leads is judged from / down
                target = os.path.realpath(cur)
                _walk(target, "/" if judging else None, links + 1)
                cur = target
            elif not stat.S_ISDIR(st.st_mode):
                raise Refused("%s is not a directory" % cur)
            break


def private_tree(dirs):
    """private_dir() of every directory, in order (the bootstrap and a local host)."""
    for d in dirs:
        private_dir(d)


def read_file(path, cap=None):
    """The bytes of a regular file, opened without following a link; None if there is none.
    With `cap`, at most cap + 1 bytes are read, so a caller tells a file over its cap from
    one at it without holding more (a sparse 1 GiB file costs 1 MiB, not 1 GiB)."""
    try:
        fd = os.open(path, READ | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read() if cap is None else f.read(cap + 1)


def _tmp_name(path):
    return "%s.%d-%s.tmp" % (path, os.getpid(), os.urandom(4).hex())


def write_new(path, data, mode=0o600):
    """Atomically replace `path` with `data`: a fresh temporary file (never a link that
    was there), mode set before the first byte, then renamed into place."""
    tmp = _tmp_name(path)
    fd = os.open(tmp, CREATE, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def copy_verified(source, target, digest, mode=0o600):
    """Copy `source` (cache/<sha256>) to `target` if its content has that sha256.

    The bytes written are the bytes hashed (one read, no link followed). Returns False,
    and removes `source`, when it is not a regular file with that content; False when
    there is no `source`."""
    try:
        fd = os.open(source, READ | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return False
    except OSError:                      # a link (ELOOP) or something else odd: not ours
        remove_quietly(source)
        return False
    tmp = _tmp_name(target)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            remove_quietly(source)
            return False
        h = hashlib.sha256()
        out = os.open(tmp, CREATE, 0o600)
        try:
            with os.fdopen(out, "wb") as dst:
                os.fchmod(dst.fileno(), mode)
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                    dst.write(chunk)
            if h.hexdigest() != digest:
                remove_quietly(tmp)
                remove_quietly(source)
                return False
            os.replace(tmp, target)
        except BaseException:
            remove_quietly(tmp)
            raise
    return True


def remove_quietly(path):
    """Remove a file; one already gone, or that cannot be removed, is no error."""
    try:
        os.unlink(path)
    except OSError:
        pass
