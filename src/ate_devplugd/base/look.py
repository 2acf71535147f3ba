"""Whether a path is there, in three answers: present, absent, or cannot look.

``os.path.exists`` and ``os.path.isdir`` say False for a path this process may not look at (EACCES on a
directory above it), so that a user other than root would read "absent" where it should read "cannot
tell". ``look`` keeps the two apart; each caller says what a path it cannot look at means for it.
"""

from __future__ import annotations

import enum
import errno
import os
import stat


class Look(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    #: The path is out of this process's sight (permission denied, a loop, an I/O error): it may be there.
    CANNOT_LOOK = "cannot look"


#: The errors that mean nothing is there.
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR})


def look(path: str, *, directory: bool = False, follow: bool = True) -> Look:
    """PRESENT when ``path`` is there (a directory, given ``directory``; itself, not its target, without
    ``follow``), ABSENT when nothing (no such directory) is, CANNOT_LOOK when that cannot be told."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        return Look.ABSENT if exc.errno in _ABSENT else Look.CANNOT_LOOK
    except ValueError:  # a NUL in the path: no such file can exist
        return Look.ABSENT
    if directory and not stat.S_ISDIR(st.st_mode):
        return Look.ABSENT
    return Look.PRESENT
