"""KVM's VM announcements: the rule on parsed properties, and the socket filter that drops them in the kernel.

The filter is a classic BPF program; the kernel runs it the same way on any socket, so an AF_UNIX
datagram pair carries the exact bytes the kernel and udevd send without root. With root, real
uevents from a real KVM_CREATE_VM check it on a netlink socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import socket
import struct
from collections.abc import Iterator

import pytest

from ate_devplugd.node import kvm_events
from tests.support import kvm_available, kvm_uevent, vm_properties

KVM_CREATE_VM = 0xAE01
DEVPATH = kvm_events.KVM_DEVPATH


def kernel_message(action: str, properties: dict[str, str], devpath: str = DEVPATH) -> bytes:
    """A uevent as the kernel sends it: ``action@devpath``, then ACTION, DEVPATH, SUBSYSTEM, the rest."""
    head = {"ACTION": action, "DEVPATH": devpath, "SUBSYSTEM": "misc"}
    return f"{action}@{devpath}\0".encode() + b"".join(f"{k}={v}\0".encode() for k, v in {**head, **properties}.items())


def udev_message(properties: list[tuple[str, str]]) -> bytes:
    """A uevent as udevd re-sends it: libudev's 40-byte header, then the properties."""
    body = b"".join(f"{k}={v}\0".encode() for k, v in properties)
    header = b"libudev\0" + struct.pack(">I", 0xFEEDCAFE) + struct.pack("=III", 40, 40, len(body))
    return header + struct.pack(">IIII", 0x4B1A4E75, 0, 0, 0) + body


def udevd_announcement(event: str) -> list[tuple[str, str]]:
    """The properties systemd 252's udevd broadcast for a VM announcement, in its order (seen on Debian 12)."""
    kvm = vm_properties(event)
    return [
        ("UDEV_DATABASE_VERSION", "1"),
        ("ACTION", "change"),
        ("DEVPATH", DEVPATH),
        ("SUBSYSTEM", "misc"),
        *((k, kvm[k]) for k in ("CREATED", "COUNT", "EVENT", "PID", "STATS_PATH")),
        ("DEVNAME", "/dev/kvm"),
        ("SEQNUM", "2532"),
        ("MAJOR", "10"),
        ("MINOR", "232"),
        ("TAGS", ":uaccess:seat:"),
    ]


@contextlib.contextmanager
def filtered_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(receiver with the filter, sender)."""
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setblocking(False)
    try:
        kvm_events.drop_in_kernel(receiver.fileno())
        yield receiver, sender
    finally:
        receiver.close()
        sender.close()


def received(sock: socket.socket) -> list[bytes]:
    out = []
    with contextlib.suppress(BlockingIOError):
        while True:
            out.append(sock.recv(65536))
    return out


class TestRule:
    def test_create_and_destroy(self) -> None:
        for event in ("create", "destroy"):
            assert kvm_events.is_vm_announcement("change", "misc", "kvm", vm_properties(event))

    def test_anything_else_is_a_hint(self) -> None:
        """A change without KVM's properties (``echo change > uevent``, udevadm trigger), other actions,
        another device, an EVENT value KVM does not send, or one of KVM's keys missing."""
        props = vm_properties("create")
        without_pid = {k: v for k, v in props.items() if k != "PID"}
        for args in (
            ("change", "misc", "kvm", {"MAJOR": "10", "MINOR": "232"}),
            ("remove", "misc", "kvm", props),
            ("add", "misc", "kvm", props),
            ("change", "misc", "vhost-net", props),
            ("change", "misc", "kvm", {**props, "EVENT": "other"}),
            ("change", "misc", "kvm", without_pid),
        ):
            assert not kvm_events.is_vm_announcement(*args), args


class TestSocketFilter:
    def test_drops_the_kernels_and_udevds_announcements_only(self) -> None:
        kept = [
            kernel_message("change", {"MAJOR": "10", "MINOR": "232", "DEVNAME": "kvm", "SEQNUM": "7"}),
            kernel_message("remove", {"MAJOR": "10", "MINOR": "232", "DEVNAME": "kvm", "SEQNUM": "8"}),
            kernel_message("add", vm_properties("create")),
            kernel_message("change", vm_properties("create"), devpath="/devices/virtual/misc/kvm2"),
            kernel_message("change", vm_properties("create"))[:60],  # shorter than a whole pattern
            udev_message([("UDEV_DATABASE_VERSION", "1"), ("ACTION", "change"), ("DEVPATH", DEVPATH)]),
            b"",
            b"x",
        ]
        dropped = [
            kernel_message("change", vm_properties("create")),
            kernel_message("change", vm_properties("destroy", count=0)),
            udev_message(udevd_announcement("create")),
            udev_message(udevd_announcement("destroy")),
            udev_message(udevd_announcement("create")[1:]),  # before UDEV_DATABASE_VERSION (systemd < 247)
        ]
        with filtered_pair() as (receiver, sender):
            for message in [*dropped, *kept]:
                sender.send(message)
            assert received(receiver) == kept

    def test_keeps_the_filter_in_place(self) -> None:
        """In front of libudev's filter: what it dropped stays dropped; a second call adds nothing."""
        ld_len, jge, ret = 0x80, 0x35, 0x06
        # "pass messages of 2 bytes or more": libudev's filter stands in the same place.
        libudev_like = [(ld_len, 0, 0, 0), (jge, 0, 1, 2), (ret, 0, 0, 0xFFFFFFFF), (ret, 0, 0, 0)]
        receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.setblocking(False)
        with receiver, sender:
            kvm_events.attach(receiver.fileno(), libudev_like)
            kvm_events.drop_in_kernel(receiver.fileno())
            kvm_events.drop_in_kernel(receiver.fileno())
            assert kvm_events.installed_program(receiver.fileno()) == kvm_events.drop_program() + libudev_like
            for message in (b"x", b"kept", kernel_message("change", vm_properties("create"))):
                sender.send(message)
            assert received(receiver) == [b"kept"]

    def test_not_a_socket(self) -> None:
        read, write = os.pipe()
        try:
            with pytest.raises(OSError) as info:
                kvm_events.drop_in_kernel(read)
            assert info.value.errno == errno.ENOTSOCK
        finally:
            os.close(read)
            os.close(write)

    def test_real_vm_lifecycles_on_a_netlink_socket(self) -> None:
        """A real KVM_CREATE_VM and teardown send two uevents; on a filtered netlink socket neither
        arrives, while a plain change uevent does."""
        if os.geteuid() != 0 or not kvm_available():
            pytest.skip("needs root and the kvm misc device")
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, 15)
        plain = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, 15)
        with nl, plain:
            nl.bind((0, 1))
            plain.bind((0, 1))
            kvm_events.drop_in_kernel(nl.fileno())
            fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
            try:
                for _ in range(5):
                    os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
            finally:
                os.close(fd)
            kvm_uevent()
            # The unfiltered socket proves the announcements were sent; the marker ends both reads.
            unfiltered = _until_marker(plain)
            filtered = _until_marker(nl)
        assert sum(b"\0EVENT=create\0" in m for m in unfiltered) >= 5
        assert sum(b"\0EVENT=destroy\0" in m for m in unfiltered) >= 5
        assert not [m for m in filtered if b"\0CREATED=" in m]


def _until_marker(sock: socket.socket) -> list[bytes]:
    """Messages up to our change uevent on kvm (one without KVM's properties), read with a deadline."""
    messages = []
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    for _ in range(10000):
        if not poller.poll(10_000):
            raise TimeoutError("no uevent within 10 s")
        message = sock.recv(65536)
        messages.append(message)
        if message.startswith(f"change@{DEVPATH}\0".encode()) and b"\0CREATED=" not in message:
            return messages
    raise AssertionError("no marker among 10000 uevents")
