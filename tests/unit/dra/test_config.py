"""The [dra] table and the mode key, validated like the rest of the config."""

from __future__ import annotations

import tomllib

import pytest

from ate_devplugd.config import dra as config


def parse(text: str, hostname: str = "Node-1.Example.com ") -> tuple[config.DraConfig, list[str]]:
    return config.from_mapping(tomllib.loads(text).get("dra"), gethostname=lambda: hostname)


class TestDefaults:
    def test_absent_table(self) -> None:
        """Without a [dra] table every default applies and the node name is kubelet's own host name."""
        cfg, errors = parse("")
        assert errors == []
        assert cfg == config.DraConfig(node_name="node-1.example.com")
        assert cfg.plugin_socket == "/var/lib/kubelet/plugins/kvm.ate.dev/dra.sock"
        assert cfg.registration_socket == "/var/lib/kubelet/plugins_registry/kvm.ate.dev-reg.sock"

    def test_all_keys(self) -> None:
        """Every key is read and paths are normalised."""
        text = """
        [dra]
        driver = "gpu.example.org"
        node_name = "worker-7"
        kubeconfig = "/etc/ate/kube//config"
        kubelet_dir = "/srv/kubelet/"
        sharing = "units"
        devices = 16
        """
        cfg, errors = parse(text)
        assert errors == []
        assert cfg == config.DraConfig(
            "worker-7", "gpu.example.org", "/etc/ate/kube/config", "/srv/kubelet", "units", 16
        )

    def test_render_round_trip(self) -> None:
        """The rendered table reads back to the same config."""
        cfg, _ = parse('[dra]\nsharing = "shared"\nnode_name = "n1"\n')
        again, errors = parse(config.render(cfg))
        assert errors == [] and again == cfg

    def test_shared_says_a_request_for_two_is_never_scheduled(self) -> None:
        """check-config's output for shared mode says that a pod asking for 2 units stays Pending, and so
        does it where the layout follows the cluster (shared from Kubernetes 1.36); units mode says nothing of it."""
        shared, _ = parse('[dra]\nsharing = "shared"\nnode_name = "n1"\n')
        text = config.render(shared)
        assert "ate.dev/kvm: 2) stays Pending" in text and "ask for 1" in text
        assert "devices =" not in text
        units, _ = parse('[dra]\nsharing = "units"\nnode_name = "n1"\n')
        assert "Pending" not in config.render(units)
        unset, _ = parse('[dra]\nnode_name = "n1"\n')
        text = config.render(unset)
        assert "sharing: not set, so the layout follows the cluster" in text and "stays Pending" in text
        assert "\nsharing =" not in text and "devices = 128" in text

    def test_unset_sharing_follows_the_cluster(self) -> None:
        """Without ``sharing`` the config leaves the layout to the cluster (None), and renders back to it."""
        cfg, errors = parse('[dra]\nnode_name = "n1"\n')
        assert errors == [] and cfg.sharing is None
        again, errors = parse(config.render(cfg))
        assert errors == [] and again == cfg
        explicit, _ = parse('[dra]\nsharing = "units"\nnode_name = "n1"\n')
        assert explicit.sharing is config.Layout.UNITS


class TestErrors:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ('driver = "Kvm_Driver"', "dra.driver: 'Kvm_Driver' must be a DNS subdomain"),
            ('driver = "' + "a" * 64 + '"', "of at most 63 characters"),
            ('node_name = "Upper"', "dra.node_name: 'Upper' must be a node name"),
            ('kubeconfig = "relative/kc"', "dra.kubeconfig: must be an absolute path, not 'relative/kc'"),
            ("kubelet_dir = 3", "dra.kubelet_dir: must be an absolute path, not 3"),
            ('sharing = "both"', "dra.sharing: must be one of units, shared, not 'both'"),
            ("devices = 129", "dra.devices: 129 must be an integer from 1 to 128"),
            ("devices = true", "dra.devices: true must be an integer"),
            ('sharing = "shared"\ndevices = 4', "dra.devices: 4 applies only to sharing"),
            ("colour = 1", "dra: unknown key 'colour'"),
            ('kubelet_dir = "/' + "d" * 90 + '"', "longer than 107 bytes"),
        ],
    )
    def test_one_error_names_key_and_value(self, text: str, expected: str) -> None:
        """A bad value gives one error line naming the key and the value."""
        _, errors = parse("[dra]\n" + text)
        assert len(errors) == 1, errors
        assert expected in errors[0]

    def test_socket_path_limit_counts_the_staging_name(self) -> None:
        """Each socket is bound under a dot-name one byte longer: that name may have 107 bytes, not one more."""
        # "/plugins_registry/.kvm.ate.dev-reg.sock", the longest bound path, adds 39 bytes.
        config, errors = parse(f'[dra]\nkubelet_dir = "/{"d" * 67}"')
        assert errors == [] and len(config.registration_socket) == 106
        _, errors = parse(f'[dra]\nkubelet_dir = "/{"d" * 68}"')
        assert (
            len(errors) == 1 and errors[0].startswith("dra.kubelet_dir: '/ddd") and "longer than 107 bytes" in errors[0]
        )

    def test_invalid_host_name(self) -> None:
        """A host name that is no node name asks for node_name to be set."""
        _, errors = parse("", hostname="bad_host")
        assert errors == [
            "dra.node_name: the host name 'bad_host' is not a valid node name; "
            "set node_name to the name of this node's Node object"
        ]

    def test_not_a_table(self) -> None:
        """dra = 3 is reported as not a table."""
        _, errors = config.from_mapping(3)  # type: ignore[arg-type]
        assert errors == ["dra: must be a table, not 3"]


class TestMode:
    @pytest.mark.parametrize(
        ("value", "mode"), [(None, "device-plugin"), ("dra", "dra"), ("device-plugin", "device-plugin")]
    )
    def test_valid(self, value: object, mode: str) -> None:
        """The mode defaults to device-plugin; both names are accepted."""
        assert config.validate_mode(value) == (mode, [])

    def test_invalid(self) -> None:
        """An unknown mode names the key and value."""
        assert config.validate_mode("both")[1] == ["mode: must be one of device-plugin, dra, not 'both'"]
