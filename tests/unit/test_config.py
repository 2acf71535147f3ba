"""Config parsing and validation: every error names the field, the table and the value."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ate_devplugd import config
from ate_devplugd.base import toml_text
from ate_devplugd.config import Config, ConfigError
from ate_devplugd.config import device as device_config
from ate_devplugd.config.device import DeviceConfig
from tests.support import subprocess_env

KVM = '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'


class TestDefaults:
    def test_empty_file_gives_the_kvm_default(self) -> None:
        """An empty file means one ate.dev/kvm device of 4096 rw units under the kubelet directory."""
        cfg = config.parse("")
        assert cfg.plugin_dir == "/var/lib/kubelet/device-plugins"
        assert cfg.dev_root == "/"
        assert cfg.devices == (DeviceConfig("ate.dev/kvm", "/dev/kvm", 4096, "rw", False, None, "misc"),)

    def test_missing_explicit_file_is_an_error(self, tmp_path: Path) -> None:
        """A --config that does not exist is an error, not silently the defaults."""
        with pytest.raises(ConfigError, match="cannot read"):
            config.load(tmp_path / "nope.toml")

    def test_full_device_table(self) -> None:
        """Every device key is read."""
        cfg = config.parse(
            'log_level = "DEBUG"\n[[device]]\nresource = "ate.dev/vhost-net"\npath = "/dev/vhost-net"\n'
            'count = 16\npermissions = "rwm"\npreopen = true\nprobe = "kvm"\nsubsystem = "misc"\n'
        )
        (dev,) = cfg.devices
        assert (dev.count, dev.permissions, dev.preopen, dev.probe) == (16, "rwm", True, "kvm")
        assert cfg.log_level == "debug"
        assert dev.socket_name == "ate.dev-vhost-net.sock"
        assert dev.id_prefix == "vhost-net-"

    def test_render_round_trips(self) -> None:
        """check-config's output parses back to the same config, CDI keys and group names included."""
        cfg = config.parse(
            'cdi_dir = "/etc/cdi"\nmetrics_file = ""\n'
            + KVM
            + 'cdi = true\ncontainer_mode = 0o660\ncontainer_uid = 0\ncontainer_gid = "kvm"\n'
            + '[[device]]\nresource = "x.io/tun"\npath = "/dev/net/tun"\nprobe = "kvm"\n',
            gid_of={"kvm": 107}.__getitem__,
        )
        text = config.render(cfg)
        assert 'container_gid = "kvm"' in text and "container_mode = 0o660" in text
        assert config.parse(text, gid_of={"kvm": 107}.__getitem__) == cfg

    @pytest.mark.parametrize(
        "text",
        [
            "",
            KVM + "cdi = true\n",
            KVM + 'cdi = "required"\ncontainer_uid = 1000\ncontainer_gid = "kvm"\n',
            'mode = "dra"\n[dra]\nnode_name = "n1"\n',
            'mode = "dra"\n[dra]\nnode_name = "n1"\nsharing = "shared"\n' + KVM,
            '[dra]\nnode_name = "n1"\nsharing = "units"\ndevices = 4\n' + KVM + 'probe = "kvm"\n',
        ],
    )
    def test_values_round_trip(self, text: str) -> None:
        """A config's values (what the daemon's record holds) read back to the same config, and the values
        of a file that writes out a default are those of one that leaves it unset: compared by value, an
        untouched file never differs from what runs (container_mode, a DRA mode's CDI, the host's name)."""
        lookup = {"kvm": 107}.__getitem__
        cfg = config.parse(text, gid_of=lookup)
        assert config.from_mapping(config.values(cfg), lookup) == cfg
        explicit = config.parse(config.render(cfg), gid_of=lookup)
        assert explicit == cfg and config.values(explicit) == config.values(cfg)

    def test_cdi_keys(self) -> None:
        """cdi = true alone: mode 0666 in the container, no owner; a group name becomes the host's gid."""
        (plain,) = config.parse(KVM + "cdi = true\n").devices
        assert (plain.cdi, plain.node_mode, plain.container_uid, plain.container_gid) == (True, 0o666, None, None)
        cfg = config.parse(KVM + 'cdi = true\ncontainer_gid = "kvm"\n', gid_of={"kvm": 107}.__getitem__)
        assert (cfg.devices[0].container_gid, cfg.devices[0].container_group) == (107, "kvm")
        assert (cfg.cdi_dir, cfg.metrics_file) == (
            "/var/run/cdi",
            "/var/lib/prometheus/node-exporter/ate-devplugd.prom",
        )

    def test_overrides_are_validated(self) -> None:
        """Command-line overrides replace file values and are checked like them."""
        cfg = Config().with_overrides(plugin_dir="/tmp/x/", log_level="warning")
        assert cfg.plugin_dir == "/tmp/x"
        with pytest.raises(ConfigError, match="--dev-root"):
            Config().with_overrides(dev_root="relative")


BAD = [
    ("unknown top-level key", "colour = 1\n", ["unknown key 'colour'"]),
    ("unknown device key", KVM + "colour = 1\n", ["device[0] (ate.dev/kvm): unknown key 'colour'"]),
    ("resource without domain", '[[device]]\nresource = "kvm"\npath = "/dev/kvm"\n', ["resource: 'kvm'"]),
    (
        "kubernetes.io resource",
        '[[device]]\nresource = "kubernetes.io/kvm"\npath = "/dev/kvm"\n',
        ["resource: 'kubernetes.io/kvm'"],
    ),
    ("requests. prefix", '[[device]]\nresource = "requests.a/kvm"\npath = "/dev/kvm"\n', ["resource:"]),
    ("two slashes", '[[device]]\nresource = "a.io/b/c"\npath = "/dev/kvm"\n', ["resource: 'a.io/b/c'"]),
    ("uppercase domain", '[[device]]\nresource = "A.io/kvm"\npath = "/dev/kvm"\n', ["resource: 'A.io/kvm'"]),
    ("relative path", '[[device]]\nresource = "a.io/kvm"\npath = "dev/kvm"\n', ["path: 'dev/kvm'"]),
    (
        "path outside /dev",
        '[[device]]\nresource = "a.io/kvm"\npath = "/etc/passwd"\n',
        ["path: '/etc/passwd'"],
    ),
    ("path with ..", '[[device]]\nresource = "a.io/kvm"\npath = "/dev/../etc/shadow"\n', ["path:"]),
    ("bare /dev", '[[device]]\nresource = "a.io/kvm"\npath = "/dev/"\n', ["path: '/dev/'"]),
    ("count 0", KVM + "count = 0\n", ["count: 0 must be an integer from 1 to 65536"]),
    ("count too big", KVM + "count = 65537\n", ["count: 65537"]),
    ("count a string", KVM + 'count = "4"\n', ["count: '4'"]),
    ("count a bool", KVM + "count = true\n", ["count: true must be an integer"]),
    ("empty permissions", KVM + 'permissions = ""\n', ["permissions: ''"]),
    ("bad permissions", KVM + 'permissions = "rwx"\n', ["permissions: 'rwx'"]),
    ("repeated permission", KVM + 'permissions = "rr"\n', ["permissions: 'rr'"]),
    ("preopen a string", KVM + 'preopen = "yes"\n', ["preopen: must be true or false, not 'yes'"]),
    ("unknown probe", KVM + 'probe = "gpu"\n', ["probe: 'gpu'"]),
    ("missing path", '[[device]]\nresource = "a.io/kvm"\n', ["device[0] (a.io/kvm): path: required"]),
    (
        "duplicate resource",
        KVM + '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm2"\n',
        ["device[1] (ate.dev/kvm): resource 'ate.dev/kvm' is already used by device[0] (ate.dev/kvm)"],
    ),
    (
        "duplicate path",
        KVM + '[[device]]\nresource = "ate.dev/kvm2"\npath = "/dev/kvm"\n',
        ["device[1] (ate.dev/kvm2): path '/dev/kvm' is already used"],
    ),
    (
        "same socket name",
        '[[device]]\nresource = "a-b/c"\npath = "/dev/x"\n[[device]]\nresource = "a/b-c"\npath = "/dev/y"\n',
        ["socket name 'a-b-c.sock'"],
    ),
    ("device not a table list", 'device = "kvm"\n', ["device: must be one or more [[device]] tables"]),
    ("empty device list", "device = []\n", ["device: must be one or more"]),
    ("plugin_dir relative", 'plugin_dir = "x"\n', ["plugin_dir: must be an absolute path, not 'x'"]),
    ("log_level unknown", 'log_level = "loud"\n', ["log_level: must be one of"]),
    ("not TOML", "[[device]\n", ["not valid TOML"]),
    ("ID too long", '[[device]]\nresource = "a.io/x"\npath = "/dev/' + "x" * 60 + '"\n', ["63 characters"]),
    (
        "cdi a string",
        KVM + 'cdi = "yes"\n',
        ["device[0] (ate.dev/kvm): cdi: must be true, false or 'required', not 'yes'"],
    ),
    ("container_mode without cdi", KVM + "container_mode = 0o666\n", ["container_mode: takes effect only with cdi"]),
    (
        "container_mode too big",
        KVM + "cdi = true\ncontainer_mode = 0o1777\n",
        ["container_mode: 0o1777 must be a file mode"],
    ),
    ("container_mode a string", KVM + 'cdi = true\ncontainer_mode = "0666"\n', ["container_mode: '0666'"]),
    ("container_uid negative", KVM + "cdi = true\ncontainer_uid = -1\n", ["container_uid: -1 must be a uid"]),
    ("unknown group", KVM + 'cdi = true\ncontainer_gid = "no-such-group"\n', ["container_gid: group 'no-such-group'"]),
    ("container_gid a float", KVM + "cdi = true\ncontainer_gid = 1.5\n", ["container_gid: 1.5 must be a gid"]),
    (
        "CDI class with a dot",
        '[[device]]\nresource = "ate.dev/kvm.v2"\npath = "/dev/kvm"\ncdi = true\n',
        ["resource: 'ate.dev/kvm.v2' is not a CDI kind"],
    ),
    ("cdi_dir relative", 'cdi_dir = "cdi"\n', ["cdi_dir: must be an absolute path, not 'cdi'"]),
    ("metrics_file not .prom", 'metrics_file = "/tmp/m.txt"\n', ["metrics_file: '/tmp/m.txt' must name a *.prom file"]),
    ("metrics_file relative", 'metrics_file = "m.prom"\n', ["metrics_file: must be an absolute path"]),
]


class TestErrors:
    @pytest.mark.parametrize(("text", "expected"), [(t, e) for _, t, e in BAD], ids=[n for n, _, _ in BAD])
    def test_bad_config_is_named(self, text: str, expected: list[str]) -> None:
        """Each bad value gives an error line that names its field and value."""
        with pytest.raises(ConfigError) as info:
            config.parse(text)
        for fragment in expected:
            assert any(fragment in line for line in info.value.errors), info.value.errors

    def test_all_errors_reported_together(self) -> None:
        """Several mistakes are reported in one go, not one per run."""
        with pytest.raises(ConfigError) as info:
            config.parse('[[device]]\nresource = "kvm"\npath = "kvm"\ncount = 0\n')
        assert len(info.value.errors) == 3


class TestResourceName:
    @pytest.mark.parametrize("name", ["ate.dev/kvm", "ate.dev/vhost-net", "example.com/a_b.c", "x/y"])
    def test_valid(self, name: str) -> None:
        """Names kubelet accepts."""
        assert device_config.is_extended_resource_name(name)

    @pytest.mark.parametrize(
        "name",
        ["kvm", "kubernetes.io/kvm", "requests.x/y", "a/b/c", "a/", "/b", "a/-b", "a_b/c", "a/" + "b" * 64],
    )
    def test_invalid(self, name: str) -> None:
        """Names kubelet rejects at Register."""
        assert not device_config.is_extended_resource_name(name)


class TestMessageBound:
    def test_65536_kvm_units_fit(self) -> None:
        """The largest count fits with short IDs, well under kubelet's 4 MiB."""
        dev = DeviceConfig("ate.dev/kvm", "/dev/kvm", count=65536)
        assert device_config.listandwatch_bytes(dev) <= device_config.MAX_MESSAGE_BYTES

    def test_long_ids_lower_the_bound(self) -> None:
        """Long device names with a large count are refused, naming the size."""
        long_path = "/dev/" + "v" * 50
        with pytest.raises(ConfigError, match="ListAndWatch message"):
            config.parse(f'[[device]]\nresource = "a.io/v"\npath = "{long_path}"\ncount = 65536\n')


class TestTomlValue:
    @pytest.mark.parametrize(
        ("toml", "written"),
        [
            ("true", "true"),
            ("false", "false"),
            ("-1", "-1"),
            ('"ate.dev/kvm"', "'ate.dev/kvm'"),
            ('"it\'s"', '"it\'s"'),
            ('"a\\nb"', '"a\\U0000000ab"'),
            ("1.5", "1.5"),
            ("inf", "inf"),
            ("nan", "nan"),
            ("[]", "[]"),
            ('[{driver = "x"}]', "[{driver = 'x'}]"),
            ('{"a b" = 1, c = [true]}', '{"a b" = 1, c = [true]}'),
            ("1979-05-27T07:32:00Z", "1979-05-27T07:32:00+00:00"),
            ("1979-05-27", "1979-05-27"),
        ],
    )
    def test_value_reads_back_as_toml(self, toml: str, written: str) -> None:
        """An error shows a value as TOML that reads back to the same value (not Python's repr)."""
        value = tomllib.loads(f"v = {toml}")["v"]
        assert toml_text.toml_value(value) == written
        again = tomllib.loads(f"v = {written}")["v"]
        assert again == value or (math.isnan(value) and math.isnan(again))

    def test_mode_in_octal_and_unset(self) -> None:
        """A file mode is shown in octal, as written; a key not given is "unset", never None."""
        assert toml_text.toml_value(0o1777, octal=True) == "0o1777"
        assert toml_text.toml_value(None) == "unset"


class TestRestartOnly:
    def test_device_tables_and_other_keys_reload(self) -> None:
        """Devices, log level, CDI and metrics settings are a reload's to change: nothing to refuse."""
        running = config.parse(KVM)
        new = config.parse('log_level = "debug"\ncdi_dir = "/run/other-cdi"\nmetrics_file = ""\n' + KVM + "count = 8\n")
        assert config.restart_only_change(running, new) is None

    def test_mode_switch_names_the_key_and_both_values(self) -> None:
        """device-plugin -> dra: one line with the new and the running value as TOML, and the [dra] table
        that came with it."""
        running = config.parse(KVM)
        new = config.parse('mode = "dra"\n' + KVM)
        assert config.restart_only_change(running, new) == (
            "mode = 'dra' (running: 'device-plugin'), [dra] added: change only on restart, "
            "so nothing of this reload was applied"
        )

    @pytest.mark.parametrize(
        ("before", "after", "named"),
        [
            ('plugin_dir = "/a"\n', 'plugin_dir = "/b"\n', "plugin_dir = '/b' (running: '/a')"),
            ('[dra]\nnode_name = "n1"\n', '[dra]\nnode_name = "n2"\n', "[dra] changed"),
            ('[dra]\nnode_name = "n1"\n', "", "[dra] removed"),
        ],
    )
    def test_each_restart_only_key(self, before: str, after: str, named: str) -> None:
        """plugin_dir and the [dra] table (even in device-plugin mode, where it is only checked)."""
        line = config.restart_only_change(config.parse(before + KVM), config.parse(after + KVM))
        assert line == f"{named}: changes only on restart, so nothing of this reload was applied"


#: ``check-config`` as the command line runs it, in a fresh interpreter: its exit code and the modules it loaded.
CHECK_CONFIG = """
import contextlib, io, json, sys
from ate_devplugd import cli
with contextlib.redirect_stdout(io.StringIO()):
    code = cli.main(["check-config", "--config", sys.argv[1]])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""
#: What only the daemon needs: the event loop, gRPC and the device registry (with its kernel view).
DAEMON_ONLY = ("asyncio", "grpc", "ate_devplugd.node.devices")


class TestCheckConfigImports:
    @pytest.mark.parametrize(
        "text", [KVM, 'mode = "dra"\n[dra]\nnode_name = "node-1"\n' + KVM], ids=["device-plugin", "dra"]
    )
    def test_loads_nothing_of_the_daemon(self, tmp_path: Path, text: str) -> None:
        """Reading a config (DRA's included, whose checks name the CDI devices) loads none of the daemon's
        modules: check-config, run by the unit's reload, stays quick."""
        path = tmp_path / "config.toml"
        path.write_text(text)
        done = subprocess.run(
            [sys.executable, "-c", CHECK_CONFIG, str(path)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(done.stdout)
        assert result["code"] == 0, done.stderr
        loaded = [name for name in result["modules"] if any(name == m or name.startswith(m + ".") for m in DAEMON_ONLY)]
        assert loaded == []
