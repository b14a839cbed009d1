"""The tiny model's chat data set, rebuilt deterministically from the interpreter's own stdlib.

Nothing is downloaded and no data file ships: every machine with Python has the CPython standard
library, so the training set and the held-out set are a pure function of the files found there.

Shape: one source file gives one or more conversations. The user asks for something in words (a
module docstring, a function's docstring, the comment above it, or a plain description made from
its name and signature) and the assistant answers with the code that does it. A module's
conversation has several turns, so the chat template and multi-turn sessions run on a model that
has seen them. ``pydoc_data.topics`` adds prose answers to "explain this topic" questions.

Invariants:
- the file list is sorted, so the order of conversations is stable;
- held-out membership is decided per *file* (per topic for ``pydoc_data``) by a stable hash of its
  relative path, so a held-out file contributes nothing to training: the two sets are disjoint;
- the same stdlib gives byte-identical texts, on any machine and in any process.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
"""Share of source files (and pydoc topics) held out for evaluation, in percent."""

MAX_ANSWER_CHARS = 3000
"""A definition longer than this is skipped: it would not fit a short training window anyway."""

MAX_CONVERSATION_CHARS = 6000
"""A module's turns are split into several conversations so that each stays near this size."""

_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_TOPICS_RELPATH = "pydoc_data/topics.py"


@dataclass(frozen=True)
class Message:
    """One chat message; ``role`` is ``user`` or ``assistant``."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant"):
            raise ValueError(f"role must be system, user or assistant, got {self.role!r}")


@dataclass(frozen=True)
class Conversation:
    """Alternating user/assistant turns taken from one source unit (``source``)."""

    source: str
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class ChatDataset:
    """Training and held-out conversations; their ``source`` sets are disjoint."""

    train: tuple[Conversation, ...]
    heldout: tuple[Conversation, ...]


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the stdlib's ``.py`` files, sorted.

    Skipped: tests, site-packages, machine-specific ``_sysconfigdata*`` and
    ``pydoc_data/topics.py`` (it becomes topic conversations instead). Generated codec tables
    (``encodings/cp1252.py`` and friends) are listed but give no conversations, see
    :func:`file_conversations`.
    """
    root = root or stdlib_root()
    out: list[str] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        relpath = rel.as_posix()
        if relpath == _TOPICS_RELPATH or rel.name.startswith("_sysconfigdata"):
            continue
        out.append(relpath)
    return sorted(out)


def is_heldout(key: str) -> bool:
    """True when the unit named ``key`` (a relative path or ``topic:<name>``) is held out.

    A stable hash (sha256, not Python's salted ``hash``) so every process agrees.
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def render_chatml(conv: Conversation) -> str:
    """The conversation as ChatML text, exactly what the shipped chat template produces."""
    return "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in conv.messages)


def _read(root: Path, relpath: str) -> str | None:
    try:
        return (root / relpath).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _is_generated_table(text: str) -> bool:
    return "gencodec.py" in text[:2000]


def _module_name(relpath: str) -> str:
    name = relpath.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _comment_above(lines: list[str], lineno: int) -> str:
    """The block of ``#`` comment lines directly above 1-based line ``lineno``, without ``#``."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    return "\n".join(reversed(out)).strip()


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}({bases})" if bases else f"class {node.name}"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {node.name}({ast.unparse(node.args)})"


def _request(node: ast.AST, lines: list[str], module: str, in_class: bool = False) -> str:
    """Words asking for the definition ``node``: its docstring, else its comment, else a description."""
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    kind = "class" if isinstance(node, ast.ClassDef) else "method" if in_class else "function"
    doc = ast.get_docstring(node)
    comment = _comment_above(lines, node.lineno if not node.decorator_list else node.decorator_list[0].lineno)
    sig = _signature(node)
    if doc:
        return f"Write the {kind} `{sig}` for `{module}`:\n\n{doc.strip()}"
    if comment:
        return f"In `{module}`, write `{sig}`.\n{comment}"
    return f"Write the {kind} `{node.name}` in `{module}`."


def _segment(lines: list[str], node: ast.stmt) -> str:
    decorators: list[ast.expr] = getattr(node, "decorator_list", [])
    start = decorators[0].lineno if decorators else node.lineno
    end = node.end_lineno or node.lineno
    return "\n".join(lines[start - 1:end])


def module_turns(relpath: str, text: str) -> list[tuple[str, str]]:
    """(user, assistant) pairs for one source file, in file order.

    The first pair asks for the module's header (docstring + imports + constants up to the first
    definition); each top-level function and class, and each method of a top-level class, then
    gets its own pair.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    module = _module_name(relpath)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    first_def = next((n for n in tree.body if isinstance(n, defs)), None)
    header_end = (first_def.decorator_list[0].lineno if first_def and first_def.decorator_list
                  else first_def.lineno if first_def else len(lines) + 1)
    header = "\n".join(lines[:header_end - 1]).strip()
    doc = ast.get_docstring(tree)
    pairs: list[tuple[str, str]] = []
    if header and len(header) <= MAX_ANSWER_CHARS:
        ask = f"Start the module `{module}`." + (f" Its docstring:\n\n{doc.strip()}" if doc else "")
        pairs.append((ask, header))
    for node in tree.body:
        if not isinstance(node, defs):
            continue
        code = _segment(lines, node)
        if len(code) <= MAX_ANSWER_CHARS:
            pairs.append((_request(node, lines, module), code))
            continue
        if isinstance(node, ast.ClassDef):  # too long as a whole: one turn per method
            for sub in node.body:
                if isinstance(sub, defs):
                    sub_code = _segment(lines, sub)
                    if len(sub_code) <= MAX_ANSWER_CHARS:
                        pairs.append((_request(sub, lines, f"{module}.{node.name}", in_class=True), sub_code))
    return pairs


def _chunk(source: str, pairs: list[tuple[str, str]]) -> list[Conversation]:
    """Group pairs into conversations of about ``MAX_CONVERSATION_CHARS`` each, in order."""
    convs: list[Conversation] = []
    current: list[Message] = []
    size = 0
    for user, assistant in pairs:
        cost = len(user) + len(assistant)
        if current and size + cost > MAX_CONVERSATION_CHARS:
            convs.append(Conversation(source, tuple(current)))
            current, size = [], 0
        current += [Message("user", user), Message("assistant", assistant)]
        size += cost
    if current:
        convs.append(Conversation(source, tuple(current)))
    return convs


def topic_conversations() -> list[Conversation]:
    """One conversation per ``pydoc_data.topics`` entry, sorted by topic name."""
    from pydoc_data.topics import topics

    convs = []
    for name in sorted(topics):
        body = topics[name].strip()
        if body:
            ask = f"Explain the Python topic `{name}`."
            convs.append(Conversation(f"topic:{name}", (Message("user", ask), Message("assistant", body))))
    return convs


def file_conversations(root: Path, relpath: str) -> list[Conversation]:
    """The conversations of one source file; none for unreadable files and generated codec tables
    (a model learns nothing from a 256-entry mapping table)."""
    text = _read(root, relpath)
    if text is None or _is_generated_table(text):
        return []
    return _chunk(relpath, module_turns(relpath, text))


def build_dataset(root: Path | None = None) -> ChatDataset:
    """All conversations, split into train and held-out by whole source unit."""
    root = root or stdlib_root()
    train: list[Conversation] = []
    heldout: list[Conversation] = []
    for relpath in source_files(root):
        (heldout if is_heldout(relpath) else train).extend(file_conversations(root, relpath))
    for conv in topic_conversations():
        (heldout if is_heldout(conv.source) else train).append(conv)
    return ChatDataset(tuple(train), tuple(heldout))


def heldout_conversations(root: Path | None = None) -> list[Conversation]:
    """Only the held-out conversations (parses only held-out files: fast); equals ``build_dataset().heldout``."""
    root = root or stdlib_root()
    out: list[Conversation] = []
    for relpath in source_files(root):
        if is_heldout(relpath):
            out.extend(file_conversations(root, relpath))
    out.extend(c for c in topic_conversations() if is_heldout(c.source))
    return out


def train_texts(root: Path | None = None) -> list[str]:
    """The training conversations as ChatML strings, in a stable order."""
    return [render_chatml(c) for c in build_dataset(root).train]


def heldout_texts(root: Path | None = None) -> list[str]:
    """The held-out conversations as ChatML strings, in a stable order."""
    return [render_chatml(c) for c in heldout_conversations(root)]
