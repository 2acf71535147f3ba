"""KVM's own VM announcements: recognised, and dropped in the kernel before they can wake the daemon.

Every ``KVM_CREATE_VM`` and every VM teardown makes the kernel send a ``change`` uevent on
``misc/kvm`` (``kvm_uevent_notify_change`` in virt/kvm/kvm_main.c): its first properties after
ACTION, DEVPATH and SUBSYSTEM are ``CREATED`` (VMs created since the module loaded) and ``COUNT``
(VMs alive), then ``EVENT=create`` or ``EVENT=destroy``, ``PID`` and, with debugfs, ``STATS_PATH``.
udevd runs its rules on each (the kvm rule sets the node's group and mode again, and udevd touches
the node's timestamps, so its ctime moves) and broadcasts it. None of this changes the device: the
node, its numbers and its driver stay as they were. A sandbox node starting and stopping VMs all day
would otherwise pay a look at every device for each one.

Two layers, each enough on its own:
- ``is_vm_announcement`` on what libudev parsed: the rule, whatever reaches the daemon.
- ``drop_in_kernel``: a classic BPF socket filter put in front of the filter libudev installed on its
  netlink socket (libudev's own verdicts are kept). The kernel runs it in the sender's context, so a
  VM announcement never wakes the daemon. It drops only messages whose start is byte for byte a KVM
  announcement as the kernel sends it (kernel source) or as udevd re-sends it (udev source, the layout
  of systemd 247 and later and of earlier releases); anything else, including a future layout, passes
  on to libudev and the first layer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Mapping

#: The kvm misc device's path in sysfs (misc devices have no parent: always under /devices/virtual).
KVM_DEVPATH = "/devices/virtual/misc/kvm"
#: kvm_uevent_notify_change's properties; EVENT takes one of the two values.
VM_EVENTS = frozenset({"create", "destroy"})
_VM_PROPERTIES = ("CREATED", "COUNT", "PID")


def is_vm_announcement(action: str, subsystem: str, sys_name: str, properties: Mapping[str, str]) -> bool:
    """Whether a uevent is KVM announcing a VM's creation or teardown (not a change of the device)."""
    return (
        action == "change"
        and subsystem == "misc"
        and sys_name == "kvm"
        and properties.get("EVENT") in VM_EVENTS
        and all(key in properties for key in _VM_PROPERTIES)
    )


# -- the socket filter ---------------------------------------------------------------------------------

# Classic BPF (linux/filter.h): (code, jt, jf, k). Loads of packet words are big-endian.
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS, _LD_LEN = 0x20, 0x28, 0x30, 0x80
_JEQ_K, _JGE_K = 0x15, 0x35
_RET_K = 0x06
_DROP, _PASS = 0, 0xFFFFFFFF
#: Jumps are 8-bit offsets: a pattern's block must stay shorter than this.
_MAX_JUMP = 255
#: BPF_MAXINSNS
_MAX_INSNS = 4096
#: asm-generic/socket.h (every Linux architecture Debian builds for but hppa); SO_GET_FILTER is the same.
SOL_SOCKET = 1
SO_ATTACH_FILTER = 26

#: libudev's netlink header: "libudev\0", the magic (big-endian), then header_size and properties_off in
#: host order; the properties follow the 40-byte header (sd-device/device-monitor.c).
_UDEV_PREFIX = b"libudev\0"
_UDEV_MAGIC = struct.pack(">I", 0xFEEDCAFE)
_UDEV_HEADER = 40
_ANNOUNCEMENT = f"ACTION=change\0DEVPATH={KVM_DEVPATH}\0SUBSYSTEM=misc\0CREATED=".encode()

Instruction = tuple[int, int, int, int]
#: A message matches a pattern when every (offset, bytes) of it is in the message.
Pattern = tuple[tuple[int, bytes], ...]

PATTERNS: tuple[Pattern, ...] = (
    # The kernel's own message: "change@DEVPATH\0" then the properties.
    ((0, f"change@{KVM_DEVPATH}\0".encode() + _ANNOUNCEMENT),),
    # udevd's re-broadcast, systemd 247 and later (udev database version 1): UDEV_DATABASE_VERSION first.
    (
        (0, _UDEV_PREFIX + _UDEV_MAGIC + struct.pack("=II", _UDEV_HEADER, _UDEV_HEADER)),
        (_UDEV_HEADER, b"UDEV_DATABASE_VERSION=1\0" + _ANNOUNCEMENT),
    ),
    # udevd's re-broadcast, earlier releases: the kernel's properties in the kernel's order.
    (
        (0, _UDEV_PREFIX + _UDEV_MAGIC + struct.pack("=II", _UDEV_HEADER, _UDEV_HEADER)),
        (_UDEV_HEADER, _ANNOUNCEMENT),
    ),
)


def drop_program(patterns: tuple[Pattern, ...] = PATTERNS) -> list[Instruction]:
    """The filter's prefix: a message matching a pattern is dropped; any other falls through past its end.

    Each pattern is one block: the message length first (a load past the end would make the kernel
    drop the message), then every word of it; a mismatch jumps to the next block.
    """
    program: list[Instruction] = []
    for pattern in patterns:
        steps = [(_LD_LEN, 0), (_JGE_K, max(offset + len(data) for offset, data in pattern))]
        for offset, data in pattern:
            for code, at, value in _loads(offset, data):
                steps += [(code, at), (_JEQ_K, value)]
        end = len(steps)  # the block's RET: a mismatch jumps just past it
        if end >= _MAX_JUMP:
            raise ValueError(f"a pattern of {end} instructions is too long for 8-bit jumps")
        for i, (code, k) in enumerate(steps):
            program.append((code, 0, end - i, k) if code in (_JEQ_K, _JGE_K) else (code, 0, 0, k))
        program.append((_RET_K, 0, 0, _DROP))
    return program


def _loads(offset: int, data: bytes) -> list[tuple[int, int, int]]:
    """(load code, offset, big-endian value) for each word (then half-word, byte) of ``data``."""
    out = []
    pos = 0
    while pos < len(data):
        size, code = next((s, c) for s, c in ((4, _LD_W_ABS), (2, _LD_H_ABS), (1, _LD_B_ABS)) if len(data) - pos >= s)
        out.append((code, offset + pos, int.from_bytes(data[pos : pos + size], "big")))
        pos += size
    return out


class _Insn(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32))


class _Prog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn)))


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc  # noqa: PLW0603 - one ctypes binding per process, made on first use
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def installed_program(fd: int) -> list[Instruction]:
    """The classic filter on socket ``fd`` (SO_GET_FILTER), empty when it has none."""
    libc = _lib()
    count = ctypes.c_uint32(0)  # SO_GET_FILTER counts instructions, not bytes
    _check(libc.getsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, None, ctypes.byref(count)))
    if count.value == 0:
        return []
    insns = (_Insn * count.value)()
    _check(libc.getsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, insns, ctypes.byref(count)))
    return [(i.code, i.jt, i.jf, i.k) for i in insns[: count.value]]


def drop_in_kernel(fd: int) -> None:
    """Put ``drop_program()`` in front of the filter socket ``fd`` has (or of one that passes all).

    Call again after libudev replaced its filter (a new subsystem match): a prefix already in place is
    not added twice. Raises OSError (ENOTSOCK for something that is not a socket).
    """
    prefix = drop_program()
    rest = installed_program(fd)
    if rest[: len(prefix)] == prefix:
        rest = rest[len(prefix) :]
    attach(fd, prefix + (rest or [(_RET_K, 0, 0, _PASS)]))


def attach(fd: int, program: list[Instruction]) -> None:
    """Make ``program`` the classic filter of socket ``fd`` (SO_ATTACH_FILTER); raises OSError."""
    if len(program) > _MAX_INSNS:
        raise OSError(errno.E2BIG, f"a socket filter of {len(program)} instructions is too long")
    insns = (_Insn * len(program))(*(_Insn(*insn) for insn in program))
    prog = _Prog(len(program), insns)
    _check(_lib().setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, ctypes.byref(prog), ctypes.sizeof(prog)))
