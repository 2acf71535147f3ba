"""ate-devplugd dra-manifests: DeviceClasses, and RBAC with an admission policy for other credentials."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ate_devplugd import cli
from ate_devplugd.commands import manifests
from ate_devplugd.config.dra import DraConfig
from tests.fakes.apivalidation import KINDS, model_errors

CONFIG = DraConfig(node_name="node-1")


def docs(text: str) -> list[dict[str, object]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


class TestRender:
    def test_device_class_per_resource(self) -> None:
        """Each resource gets a DeviceClass selecting the driver's devices of that resource, mapped to its name."""
        objs = docs(manifests.render(CONFIG, ["ate.dev/kvm", "ate.dev/vhost-net"], with_access=False))
        reader = "ate-devplugd.kvm.ate.dev.deviceclass-reader"
        assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [  # type: ignore[index]
            ("DeviceClass", "kvm.ate.dev"),
            ("DeviceClass", "vhost-net.ate.dev"),
            ("ClusterRole", reader),
            ("ClusterRoleBinding", reader),
        ]
        spec = objs[0]["spec"]
        assert spec == {  # type: ignore[comparison-overlap]
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "kvm.ate.dev" && '
                        'device.attributes["kvm.ate.dev"].resource == "ate.dev/kvm"'
                    }
                }
            ],
            "extendedResourceName": "ate.dev/kvm",
        }

    def test_access_objects(self) -> None:
        """The RBAC grants what the driver calls and what doctor reads, and the policy binds slices to the token's
        node and the driver."""
        objs = docs(manifests.render(CONFIG, ["ate.dev/kvm"]))
        kinds = [o["kind"] for o in objs]
        assert kinds == [
            "DeviceClass",
            "Namespace",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ]
        names = {o["metadata"]["name"] for o in objs if o["kind"] not in ("DeviceClass", "Namespace", "ServiceAccount")}  # type: ignore[index]
        assert names == {"ate-devplugd.kvm.ate.dev"}
        role = next(o for o in objs if o["kind"] == "ClusterRole")
        rules = {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]}  # type: ignore[index, union-attr]
        assert ("resourceclaims", ("get",)) in rules and ("nodes", ("get", "list", "watch")) in rules
        assert ("deviceclasses", ("get", "list")) in rules  # doctor's read, which kubelet's credentials lack
        policy = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy")
        text = yaml.safe_dump(policy)
        assert "authentication.kubernetes.io/node-name" in text and "kvm.ate.dev" in text

    def test_objects_are_valid_models(self) -> None:
        """Every object decodes into the kubernetes client's model with no field lost (venv only)."""
        for obj in docs(manifests.render(CONFIG, ["ate.dev/kvm"])):
            assert model_errors(obj, KINDS[obj["kind"]][3]) == []  # type: ignore[index]


class TestCommand:
    def test_stages(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """``dra-manifests --stage policy`` then ``--stage grant`` print the two halves, the grant last."""
        config = tmp_path / "config.toml"
        config.write_text("")
        kinds = {}
        for stage in manifests.STAGES:
            assert cli.main(["dra-manifests", "--stage", stage, "--config", str(config)]) == 0
            kinds[stage] = [d["kind"] for d in docs(capsys.readouterr().out)]
        assert kinds["grant"] == ["ClusterRole", "ClusterRoleBinding"]
        assert kinds["policy"][-2:] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]

    def test_stage_is_not_for_kubelet_credentials(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """kubelet's credentials need no policy and no grant: asking for a stage with them is a usage error."""
        with pytest.raises(SystemExit) as exit_:
            cli.main(["dra-manifests", "--stage", "grant", "--kubelet-credentials"])
        assert exit_.value.code == 2
        assert "not allowed with argument" in capsys.readouterr().err

    def test_unknown_stage(self) -> None:
        with pytest.raises(ValueError, match="not one of policy, grant"):
            manifests.render(CONFIG, ["ate.dev/kvm"], stage="later")
