"""An archive's requirements file, read as a list of package requirements and nothing else.

pip reads a requirements file as a command line: besides `name[extras]>=version; markers` a line
may be an option (`-r other.txt`, `-c`, `-e`, `--index-url`, `--extra-index-url`, `-f`,
`--trusted-host`, `--hash` ...), a local path (`./pkg`, `../x.whl`) or a URL. From an archive each
of those reaches beyond packages: `-r ../../secret` has pip read, and quote in its error, a file
outside the archive; an index option sends the install to a host of the archive's choosing; a
path or a URL runs a setup.py the archive picked, as the server's user.

So the file is parsed here, never by pip: each line must be one PEP 508 requirement with a
package name (extras, version specifiers and environment markers allowed), no URL (`name @ url`),
no option, no path. The first line that is not is refused with its number and what is allowed.
pip is then given the parsed requirements, rewritten in packaging's canonical form, as its
arguments — the file itself never reaches it. The file's size and line count are capped, and it
must be UTF-8.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from mariner.server.contracts.capped_text import TextRefused, capped_text

MAX_FILE_BYTES = 64 * 1024
MAX_REQUIREMENTS = 500
# Names pip would take for a local archive file rather than a package of the index.
_ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz")
# pip's comment rule: '#' at the start of a line or after whitespace starts a comment.
_COMMENT = re.compile(r"(^|\s+)#.*$")
ALLOWED = (
    "each line is one package requirement: a name with optional extras, version specifiers and "
    "environment markers, e.g. 'numpy>=1.26,<3; python_version >= \"3.10\"' (no options such as "
    "-r, -c, -e, --index-url or --hash, no paths, no URLs)"
)


class RequirementsRefused(ValueError):
    """The requirements file is not a list of package requirements; the message says where and why."""


def read_requirements(path: Path, *, shown_as: str) -> list[str]:
    """The requirements of the file at `path`, each in canonical form; `shown_as` names the file in
    errors (its name inside the archive)."""
    with path.open("rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)  # one byte past the cap is enough to refuse it
    try:
        text = capped_text(raw, MAX_FILE_BYTES, bom=True)
    except TextRefused as exc:
        raise RequirementsRefused(f"{shown_as} {exc}") from None
    return parse_requirements(text, shown_as=shown_as)


def parse_requirements(text: str, *, shown_as: str) -> list[str]:
    """Each non-blank, non-comment line of `text` as one checked requirement (module docstring)."""
    found: list[str] = []
    for number, line in _logical_lines(text):
        spec = _COMMENT.sub("", line).strip()
        if not spec:
            continue
        where = f"{shown_as} line {number}"
        if len(found) == MAX_REQUIREMENTS:
            raise RequirementsRefused(f"{where}: more than {MAX_REQUIREMENTS} requirements")
        found.append(str(_requirement(spec, where)))
    return found


def _requirement(spec: str, where: str) -> Requirement:
    shown = spec if len(spec) <= 120 else spec[:117] + "..."
    if spec.startswith("-"):
        raise RequirementsRefused(f"{where}: {shown!r} is a pip option; {ALLOWED}")
    try:
        req = Requirement(spec)
    except InvalidRequirement:
        raise RequirementsRefused(f"{where}: {shown!r} is not a package requirement; {ALLOWED}") from None
    if req.url is not None:
        raise RequirementsRefused(f"{where}: {shown!r} names a URL; {ALLOWED}")
    if req.name.lower().endswith(_ARCHIVE_SUFFIXES):
        raise RequirementsRefused(f"{where}: {shown!r} names a file, not a package; {ALLOWED}")
    return req


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines joined where one ends in a backslash (as pip joins them), each with its first line's
    number."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        out.append((start, "".join(pending)))
        pending = []
    if pending:
        out.append((start, "".join(pending)))
    return out
