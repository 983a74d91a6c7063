"""The decisive lines of CRIU and runc logs.

A failed dump or restore must reach the user as the lines that explain it
("inet: Connected TCP socket, consider using --tcp-established option"),
never as runc's bare "criu failed: type NOTIFY errno 0".

CRIU log lines look like::

    (00.012345) Error (criu/sk-inet.c:123): sockets: Can't get 1:16 opt: ...
    (00.068542)      1: Error (criu/files-reg.c:1970): File x has bad size 10 (expect 8)
    (00.100000) pie: 1: Error (criu/pie/restorer.c:99): ...

`decisive_lines` keeps the messages of the Error lines (timestamp, pid and
source location removed), drops the harmless noise of these machines and the
generic tail lines when something more specific exists, and falls back to the
last non-empty lines when the log holds no error at all.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Iterable

# Longest line returned; longer ones are cut and end with an ellipsis.
MAX_LINE_CHARS = 1000

# Messages that appear in every log on these machines and explain nothing.
_NOISE = ("rlimit: Can't setup RLIMIT_NOFILE for self",)

# Messages that only say that the whole operation failed (rank 2), and
# wrappers that only say that one step of it failed (rank 1).
_GENERIC_RE = r"^(?:(?:Pre-)?[Dd]umping|Restoring|Lazy pages|Checking) FAILED\.?$"
_WRAPPER_RE = (
    r"failed with -?\d+\.?$"
    r"|^\d+ exited, status=-?\d+$"
    r"|^\d+ killed by signal \d+"
    r"|^Dump(?:ing)? .*\(pid: \d+\) failed"
    r"|^Restore of task \d+ failed"
)

_LOGRUS_LEVELS = frozenset({"trace", "debug", "info", "warning", "error", "fatal", "panic"})
_RUNC_ERROR_LEVELS = frozenset({"error", "fatal", "panic"})

_compiled: dict[str, re.Pattern[str]] = {}


def _pattern(name: str) -> re.Pattern[str]:
    """Compile the named regular expression on first use."""
    pat = _compiled.get(name)
    if pat is None:
        import re

        sources = {
            # "(00.012345)" then optional "pie:" and pid prefixes.
            "stamp": r"^\(\s*\d+(?:\.\d+)?\)\s*(?:pie:\s*)?(?:\d+:\s+)?",
            # "Error (criu/x.c:12): message"; the location is optional only
            # after a timestamp.
            "level_loc": r"^(Error|Warn)\s*\([^()]*\)\s*:\s?",
            "level_bare": r"^(Error|Warn)\s*:\s?",
            "generic": _GENERIC_RE,
            "wrapper": _WRAPPER_RE,
            "plain_error": r"(?i)\b(?:error|fatal|failed|panic)\b",
            "logfmt_level": r"(?:^|\s)level=\"?(\w+)\"?",
            "logfmt_msg": r"(?:^|\s)msg=(\"(?:[^\"\\]|\\.)*\"|\S+)",
            "log_file": r"log file: (.+?)(?:;|$)",
        }
        pat = re.compile(sources[name])
        _compiled[name] = pat
    return pat


def _clean(text: str) -> str:
    """Escape control characters and cut overlong lines."""
    text = text.strip()
    if not text.isprintable():
        text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    if len(text) > MAX_LINE_CHARS:
        text = text[: MAX_LINE_CHARS - 1] + "\u2026"
    return text


def _parse_criu_line(line: str) -> tuple[str | None, str]:
    """Split a CRIU log line into (level or None, message)."""
    stamp = _pattern("stamp").match(line)
    rest = line[stamp.end():] if stamp else line.strip()
    m = _pattern("level_loc").match(rest)
    if m is None and stamp is not None:
        m = _pattern("level_bare").match(rest)
    if m is None:
        return None, rest
    return m.group(1), rest[m.end():]


def _is_noise(message: str) -> bool:
    return any(n in message for n in _NOISE)


def _rank(message: str) -> int:
    """0: specific, 1: a wrapper of a step, 2: the generic tail line."""
    if _pattern("generic").search(message):
        return 2
    if _pattern("wrapper").search(message):
        return 1
    return 0


def decisive_lines(text: str, *, limit: int = 6) -> list[str]:
    """The lines of a CRIU log that explain its failure, most specific first kept."""
    if limit <= 0:
        return []
    errors: list[tuple[int, int, str]] = []  # (rank, position, message)
    seen: set[str] = set()
    tail: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        level, message = _parse_criu_line(line)
        message = _clean(message)
        if not message or _is_noise(message):
            continue
        if level == "Error":
            if message not in seen:
                seen.add(message)
                errors.append((_rank(message), len(errors), message))
        else:
            tail.append(f"{level}: {message}" if level else message)
            if len(tail) > limit:
                del tail[0]
    if not errors:
        return tail
    if any(rank < 2 for rank, _, _ in errors):
        errors = [e for e in errors if e[0] < 2]
    chosen = sorted(errors)[:limit]
    return [message for _, _, message in sorted(chosen, key=lambda e: e[1])]


def read_decisive(path: str, *, limit: int = 6, tail_bytes: int = 1 << 20) -> list[str]:
    """`decisive_lines` of the last `tail_bytes` of a log file; [] if it is missing."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(0, size - tail_bytes)
            f.seek(start)
            data = f.read(tail_bytes)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [_clean(f"cannot read log {path}: {e.strerror or e}")]
    if start > 0:
        # The first line is probably cut; drop it.
        newline = data.find(b"\n")
        data = data[newline + 1:] if newline >= 0 else b""
    return decisive_lines(data.decode("utf-8", "replace"), limit=limit)


def _unquote(value: str) -> str:
    """Undo Go's %q quoting of a logfmt value (best effort)."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        import json

        try:
            result = json.loads(value)
        except ValueError:
            return value[1:-1]
        return result if isinstance(result, str) else value[1:-1]
    return value


def _one_line(msg: str) -> str:
    """Join a multi-line message into one clean line."""
    return "; ".join(_clean(part) for part in msg.splitlines() if part.strip())


def runc_log_errors(text: str) -> list[str]:
    """Messages at level error/fatal/panic from a runc log (JSON, logfmt or plain)."""
    result: list[str] = []
    seen: set[str] = set()

    def add(msg: str) -> None:
        line = _one_line(msg)
        if line and line not in seen:
            seen.add(line)
            result.append(line)

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            import json

            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                level = entry.get("level")
                msg = entry.get("msg")
                if isinstance(level, str) and level.lower() in _RUNC_ERROR_LEVELS:
                    add(msg if isinstance(msg, str) else str(msg))
                continue
        level_m = _pattern("logfmt_level").search(line)
        msg_m = _pattern("logfmt_msg").search(line)
        if level_m is not None and msg_m is not None:
            if level_m.group(1).lower() in _RUNC_ERROR_LEVELS:
                add(_unquote(msg_m.group(1)))
            continue
        if _pattern("plain_error").search(line):
            add(line)
    return result


def criu_log_path(messages: Iterable[str]) -> str | None:
    """The CRIU log named by runc's "criu failed: ... log file: PATH" message."""
    for message in messages:
        m = _pattern("log_file").search(message)
        if m is not None:
            return m.group(1).strip()
    return None


def format_runc_log_line(level: str, msg: str) -> str:
    """One JSON log line in runc's format, newline included.

    containerd's shim reports the msg of the last line with level "error" in
    runc's log as the runtime error, so a wrapper appends its own failure here.
    """
    import json
    import time

    lvl = level.lower()
    if lvl == "warn":
        lvl = "warning"
    if lvl not in _LOGRUS_LEVELS:
        raise ValueError(f"unknown log level {level!r}")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return json.dumps({"level": lvl, "msg": msg, "time": stamp}, separators=(",", ":")) + "\n"
