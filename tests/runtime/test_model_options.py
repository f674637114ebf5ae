"""Model options (issue 46 item 3): an architecture registered with an options dataclass
(``model.options.*``) has them checked against the group's members and spelled out at resolution,
hashed like ``algo.*``, and built into every model the run makes, the algorithms' included."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from torch import nn

from conftest import SMOKE
from htfl_dist.algorithms import AlgorithmContext
from htfl_dist.algorithms.shared_model import build_shared_model
from htfl_dist.config import TrainConfig, bounded, load_yaml
from htfl_dist.errors import ConfigError
from htfl_dist.models import InputSpec, SplitModel, build_model, spelled_out_model_options
from htfl_dist.models import registry as model_registry
from htfl_dist.models.cost import forward_flops_per_sample
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime.simulate import simulate


@dataclasses.dataclass
class MlpOptions:
    hidden: int = bounded(16, at_least=1, at_most=256)
    """The width of the extractor's one hidden layer."""


@dataclasses.dataclass
class WideOptions:
    hidden: int = bounded(32, at_least=1)
    depth: int = bounded(1, at_least=1)


BUILT: list[int] = []
"""The ``hidden`` of every test_mlp built during a test, in order (which call sites passed the options)."""


def build_mlp(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
              options: MlpOptions) -> SplitModel:
    """A plugin's image model whose width is its option: flatten, Linear to ``hidden``, ReLU, Linear to K."""
    BUILT.append(options.hidden)
    extractor = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, options.hidden),
                              nn.ReLU(), nn.Linear(options.hidden, feature_dim))
    return SplitModel(extractor, nn.Linear(feature_dim, num_classes), feature_dim, arch="test_mlp")


def build_wide(*, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
               options: WideOptions) -> SplitModel:
    return build_mlp(num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
                     image_size=image_size, options=MlpOptions(options.hidden))


@pytest.fixture
def architectures(monkeypatch):
    """test_mlp (hidden, default 16) and test_wide (hidden default 32, depth) in a scratch copy of
    the architecture registry, the real one for the test's length (the run finds them there)."""
    monkeypatch.setattr(model_registry, "_ARCHITECTURES", model_registry._ARCHITECTURES.copy())  # undone after
    model_registry.register_architecture("test_mlp", options=MlpOptions)(build_mlp)
    model_registry.register_architecture("test_wide", options=WideOptions)(build_wide)
    BUILT.clear()


def _first_weight(model: SplitModel) -> tuple[int, ...]:
    extractor = model.feature_extractor
    assert isinstance(extractor, nn.Sequential) and isinstance(extractor[1], nn.Linear)
    return tuple(extractor[1].weight.shape)


def test_build_model_gives_the_model_the_option_s_width(architectures):
    picture = InputSpec.image(1, 4)  # 16 inputs
    assert _first_weight(build_model("test_mlp", num_classes=3, feature_dim=4, inputs=picture)) == (16, 16)
    eight = build_model("test_mlp", num_classes=3, feature_dim=4, inputs=picture, options={"hidden": 8, "depth": 2})
    assert _first_weight(eight) == (8, 16)  # depth is test_wide's: ignored here
    assert _first_weight(build_model("test_wide:fc", num_classes=3, feature_dim=4, inputs=picture)) == (32, 16)
    with pytest.raises(ConfigError, match=r"^config key 'model.options.hidden' must be in \[1, 256\], got 0$"):
        build_model("test_mlp", num_classes=3, feature_dim=4, inputs=picture, options={"hidden": 0})
    # an architecture without options is built as before, whatever the mapping holds
    assert build_model("cnn", num_classes=3, feature_dim=4, in_channels=1, image_size=28,
                       options={"hidden": 8}).feature_dim == 4


def test_the_counted_flops_follow_the_option(architectures):
    """Forward FLOPs of one 1x4x4 sample, K=4, 3 classes: 2·16·h + 2·h·4 + 2·4·3 (ReLU uncounted)."""
    picture = InputSpec.image(1, 4)
    assert forward_flops_per_sample("test_mlp", num_classes=3, feature_dim=4, inputs=picture) == 664  # h = 16
    assert forward_flops_per_sample("test_mlp", num_classes=3, feature_dim=4, inputs=picture,
                                    options={"hidden": 8}) == 344


def test_an_algorithm_builds_its_models_with_the_context_s_options(architectures):
    context = AlgorithmContext(num_classes=3, feature_dim=4, seed=0, train=TrainConfig(),
                               options=SimpleNamespace(shared_model="test_mlp"), model_group="test_mlp",
                               in_channels=1, image_size=4, model_options={"hidden": 8})
    assert _first_weight(build_shared_model(context)) == (8, 16)
    assert _first_weight(build_shared_model(dataclasses.replace(context, model_options={}))) == (16, 16)


def test_resolution_spells_out_and_refuses(architectures):
    assert spelled_out_model_options("test_mlp", {}) == {"hidden": 16}
    assert spelled_out_model_options("test_mlp:fc512,cnn", {"hidden": 8}) == {"hidden": 8}
    assert spelled_out_model_options("HtCNN8", {}) == {}
    # the union of two members' fields; one value for the key both read, once written
    assert spelled_out_model_options("test_mlp,test_wide", {"hidden": 8}) == {"hidden": 8, "depth": 1}
    with pytest.raises(ConfigError, match=r"^config key 'model.options.hidden': architectures test_mlp and "
                                          r"test_wide of model group 'test_mlp,test_wide' read it as 16 and 32; "
                                          r"set it explicitly$"):
        spelled_out_model_options("test_mlp,test_wide", {})
    with pytest.raises(ConfigError, match=r"^unknown config key 'model.options.depth': the architectures of model "
                                          r"group 'test_mlp,cnn' declare test_mlp: hidden$"):
        spelled_out_model_options("test_mlp,cnn", {"depth": 2})
    with pytest.raises(ConfigError, match=r"^unknown config key 'model.options.hidden': no architecture of model "
                                          r"group 'HtCNN8' declares options; leave model.options empty$"):
        spelled_out_model_options("HtCNN8", {"hidden": 8})
    with pytest.raises(ConfigError, match=r"^config key 'model.options.hidden' must be in \[1, 256\], got 300$"):
        spelled_out_model_options("test_mlp", {"hidden": 300})
    with pytest.raises(TypeError, match="must be a dataclass"):
        model_registry.register_architecture("test_bad", options=dict)(build_mlp)


def test_options_are_hashed_as_written_out(architectures):
    sixteen = resolved_config(None, ["model.group=test_mlp"])
    assert sixteen.model.options == {"hidden": 16} and sixteen.experiment()["model"]["options"] == {"hidden": 16}
    assert resolved_config(None, ["model.group=test_mlp", "model.options.hidden=16"]).config_hash() == \
        sixteen.config_hash()  # the default written out is the same experiment
    assert resolved_config(None, ["model.group=test_mlp", "model.options.hidden=8"]).config_hash() != \
        sixteen.config_hash()
    plain = resolved_config(None, [])
    assert plain.model.options == {} and "options" not in plain.experiment()["model"]  # no options: hash as before


@pytest.mark.integration
@pytest.mark.parametrize(("algorithm", "group"), [("fml", "test_mlp,test_mlp:fc512"), ("lgfedavg", "test_mlp")])
def test_a_run_builds_every_model_with_the_option(architectures, algorithm, group, tmp_path, cache_dir):
    """Two rounds on test_mlp with hidden=8: the clients' models, FML's shared model, LG-FedAvg's
    check of the heads (on the meta device) and its server copy of client 0's initial model are
    all built 8 wide."""
    rows = simulate(SMOKE, [f"algorithm={algorithm}", f"model.group={group}", "model.options.hidden=8",
                            f"data.cache_dir={cache_dir}", "rounds=2", "num_clients=3"], out=tmp_path / "run")
    assert len(rows) == 2 and all(0.0 <= row["test_acc"] <= 1.0 for row in rows)
    assert BUILT and set(BUILT) == {8}
    assert load_yaml((tmp_path / "run" / "config.yaml").read_text())["model"]["options"] == {"hidden": 8}
