"""The file-backed generators (``stylegan_pickle``, ``torchscript``) and the built-in DCGAN's
safe loading, exercised on tiny generators written by the tests themselves (no downloads).

The StyleGAN stand-in lives in its own importable package in a temporary directory, as a real
StyleGAN checkout would: a network pickle references its classes by module name, so whether that
package is on ``sys.path`` is exactly what decides whether the pickle loads.
"""
from __future__ import annotations

import importlib
import pickle
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from htfl_dist.errors import ConfigError
from htfl_dist.generators import GeneratorConfig, build_generator, dcgan, generator_names
from htfl_dist.generators.files import StyleGANPickleGenerator, TorchScriptGenerator
from htfl_dist.generators.registry import file_sha256

PACKAGE = "tiny_stylegan"
Z_DIM, W_DIM, NUM_WS, RESOLUTION = 8, 12, 4, 16

TINY_STYLEGAN = '''"""A tiny generator with StyleGAN's interface (G_ema attributes, mapping, synthesis)."""
import torch
from torch import nn


class MappingNetwork(nn.Module):
    def __init__(self, z_dim, c_dim, w_dim, num_ws):
        super().__init__()
        self.z_dim, self.c_dim, self.w_dim, self.num_ws = z_dim, c_dim, w_dim, num_ws
        self.embed = nn.Linear(c_dim, z_dim) if c_dim > 0 else None
        self.fc0 = nn.Linear(z_dim * (2 if c_dim > 0 else 1), w_dim)
        self.fc1 = nn.Linear(w_dim, w_dim)
        self.register_buffer("w_avg", torch.zeros(w_dim))

    def forward(self, z, c, truncation_psi=1, truncation_cutoff=None, update_emas=False):
        assert z.shape[1] == self.z_dim and tuple(c.shape) == (z.shape[0], self.c_dim)
        x = torch.cat([z, self.embed(c)], dim=1) if self.c_dim > 0 else z
        w = self.fc1(torch.nn.functional.leaky_relu(self.fc0(x), 0.2))
        ws = w.unsqueeze(1).repeat(1, self.num_ws, 1)
        if truncation_psi != 1:
            ws = self.w_avg.lerp(ws, truncation_psi)
        return ws


class SynthesisNetwork(nn.Module):
    def __init__(self, w_dim, num_ws, img_channels, img_resolution):
        super().__init__()
        self.w_dim, self.num_ws, self.half = w_dim, num_ws, img_resolution // 2
        self.fc = nn.Linear(w_dim, 8 * self.half * self.half)
        self.up = nn.ConvTranspose2d(8, img_channels, 4, 2, 1)

    def forward(self, ws, noise_mode="random", **layer_kwargs):
        assert tuple(ws.shape[1:]) == (self.num_ws, self.w_dim)
        x = self.fc(ws.mean(dim=1)).view(-1, 8, self.half, self.half)
        if noise_mode == "random":
            x = x + torch.randn_like(x)
        return torch.tanh(self.up(x))


class Generator(nn.Module):
    def __init__(self, z_dim=8, c_dim=0, w_dim=12, num_ws=4, img_channels=3, img_resolution=16, seed=0):
        super().__init__()
        self.z_dim, self.c_dim, self.w_dim, self.num_ws = z_dim, c_dim, w_dim, num_ws
        self.img_channels, self.img_resolution = img_channels, img_resolution
        self.mapping = MappingNetwork(z_dim, c_dim, w_dim, num_ws)
        self.synthesis = SynthesisNetwork(w_dim, num_ws, img_channels, img_resolution)
        stream = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                tensor.copy_(torch.randn(tensor.shape, generator=stream) * 0.5)

    def forward(self, z, c, truncation_psi=1, noise_mode="random"):
        return self.synthesis(self.mapping(z, c, truncation_psi=truncation_psi), noise_mode=noise_mode)
'''


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    """The error's message, after checking it is the one line the CLI prints."""
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# stylegan_pickle
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stylegan_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the package ``tiny_stylegan`` (the user's "StyleGAN checkout")."""
    root = tmp_path_factory.mktemp("stylegan-code")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "networks.py").write_text(TINY_STYLEGAN)
    return root


def _forget_package() -> None:
    for name in [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@pytest.fixture
def networks(stylegan_code: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``tiny_stylegan.networks`` importable (its directory on sys.path, as PYTHONPATH would put it)."""
    monkeypatch.syspath_prepend(str(stylegan_code))
    yield importlib.import_module(f"{PACKAGE}.networks")
    _forget_package()


def write_network_pickle(networks: ModuleType, path: Path, **kwargs: int) -> nn.Module:
    """Pickle {"G_ema": G} the way NVIDIA's training loop does; returns G."""
    module = networks.Generator(**kwargs).eval().requires_grad_(False)
    with open(path, "wb") as handle:
        pickle.dump({"G": module, "G_ema": module, "training_set_kwargs": None}, handle)
    return module


def stylegan_config(path: Path | str, **overrides: object) -> GeneratorConfig:
    fields: dict[str, object] = {"name": "stylegan_pickle", "path": str(path), "latent_dim": W_DIM,
                                 "trust_pickle": True}
    fields.update(overrides)
    return GeneratorConfig(**fields)  # type: ignore[arg-type]


def test_both_generators_are_registered() -> None:
    assert {"stylegan_pickle", "torchscript"} <= set(generator_names())


def test_stylegan_pickle_refused_without_trust_before_opening(networks: ModuleType, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # A path that does not exist still gets the trust message: the file is not even looked at.
    with pytest.raises(ConfigError) as excinfo:
        build_generator(stylegan_config(tmp_path / "absent.pkl", trust_pickle=False), seed=0)
    message = one_line(excinfo)
    assert "generator.trust_pickle=true" in message and "pickle" in message and "absent.pkl" not in message

    # A real network pickle is refused just the same, without unpickling it.
    path = tmp_path / "network.pkl"
    write_network_pickle(networks, path)
    monkeypatch.setattr(pickle, "load", lambda *args, **kwargs: pytest.fail("unpickled without trust"))
    with pytest.raises(ConfigError, match=r"generator\.trust_pickle=true"):
        build_generator(stylegan_config(path, trust_pickle=False), seed=0)


def test_stylegan_pickle_latents_and_images(networks: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "network.pkl"
    reference = write_network_pickle(networks, path, seed=3)
    generator = build_generator(stylegan_config(path), seed=0)
    assert isinstance(generator, StyleGANPickleGenerator)
    assert (generator.latent_dim, generator.image_channels, generator.image_resolution) == (W_DIM, 3, RESOLUTION)
    assert generator.device == torch.device("cpu") and generator.to(torch.device("cpu")) is generator
    assert not any(parameter.requires_grad for parameter in generator.module.parameters())
    assert not generator.module.training

    latents = generator.sample_latents(5, torch.Generator().manual_seed(1))
    assert latents.shape == (5, W_DIM) and latents.dtype == torch.float32 and not latents.requires_grad
    assert not torch.allclose(latents[0], latents[1])
    # Valid latents are w = first row of mapping(z, c) for z ~ N(0, I) drawn from the given stream.
    z = torch.randn(5, Z_DIM, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(latents, reference.mapping(z, torch.zeros(5, 0))[:, 0])
    # Equal streams give equal latents, different streams different ones.
    torch.testing.assert_close(latents, generator.sample_latents(5, torch.Generator().manual_seed(1)),
                               rtol=0, atol=0)
    assert not torch.allclose(latents, generator.sample_latents(5, torch.Generator().manual_seed(2)))

    images = generator.synthesize(latents)
    assert images.shape == (5, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.float32
    assert images.min() >= -1 and images.max() <= 1 and images.std() > 0
    # Constant noise: the same latents give the same images (the tiny network adds fresh noise
    # unless noise_mode="const", and broadcasts w to every layer as the adapter must).
    torch.testing.assert_close(generator.synthesize(latents), images, rtol=0, atol=0)
    expected = reference.synthesis(latents.unsqueeze(1).repeat(1, NUM_WS, 1), noise_mode="const")
    torch.testing.assert_close(images, expected)

    provenance = generator.provenance()
    assert provenance["sha256"] == file_sha256(path) and provenance["path"] == str(path)
    assert {key: provenance[key] for key in ("name", "z_dim", "c_dim", "w_dim", "num_ws", "resolution",
                                             "truncation")} == {
        "name": "stylegan_pickle", "z_dim": Z_DIM, "c_dim": 0, "w_dim": W_DIM, "num_ws": NUM_WS,
        "resolution": RESOLUTION, "truncation": 1.0}
    assert provenance["parameters"] == sum(p.numel() for p in reference.parameters())


def test_stylegan_pickle_truncation_pulls_towards_w_avg(networks: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "network.pkl"
    write_network_pickle(networks, path)
    plain = build_generator(stylegan_config(path), seed=0)
    truncated = build_generator(stylegan_config(path, truncation=0.5), seed=0)
    w = plain.sample_latents(4, torch.Generator().manual_seed(7))
    w_half = truncated.sample_latents(4, torch.Generator().manual_seed(7))
    w_avg = truncated.module.mapping.w_avg
    torch.testing.assert_close(w_half, w_avg + 0.5 * (w - w_avg))
    assert truncated.provenance()["truncation"] == 0.5


def test_stylegan_pickle_conditional_draws_one_hot_classes(networks: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "conditional.pkl"
    reference = write_network_pickle(networks, path, c_dim=5, seed=4)
    generator = build_generator(stylegan_config(path), seed=0)
    assert generator.provenance()["c_dim"] == 5
    latents = generator.sample_latents(6, torch.Generator().manual_seed(2))
    # z first, then uniformly random classes, both from the same stream.
    stream = torch.Generator().manual_seed(2)
    z = torch.randn(6, Z_DIM, generator=stream)
    labels = nn.functional.one_hot(torch.randint(5, (6,), generator=stream), 5).float()
    torch.testing.assert_close(latents, reference.mapping(z, labels)[:, 0])
    images = generator.synthesize(latents)
    assert images.shape == (6, 3, RESOLUTION, RESOLUTION) and bool(torch.isfinite(images).all())


def test_stylegan_pickle_declared_latent_dim_must_match(networks: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "network.pkl"
    write_network_pickle(networks, path)
    with pytest.raises(ConfigError) as excinfo:
        build_generator(stylegan_config(path, latent_dim=W_DIM + 1), seed=0)
    assert f"set generator.latent_dim={W_DIM}" in one_line(excinfo)


def test_stylegan_pickle_sha256_is_checked_before_unpickling(networks: ModuleType, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "network.pkl"
    write_network_pickle(networks, path)
    digest = file_sha256(path)
    assert build_generator(stylegan_config(path, sha256=digest), seed=0).provenance()["sha256"] == digest
    flip_one_byte(path)
    monkeypatch.setattr(pickle, "load", lambda *args, **kwargs: pytest.fail("unpickled a changed file"))
    with pytest.raises(ConfigError) as excinfo:
        build_generator(stylegan_config(path, sha256=digest), seed=0)
    assert "sha256" in one_line(excinfo) and digest in str(excinfo.value)


def test_stylegan_pickle_without_the_stylegan_code_says_pythonpath(networks: ModuleType, stylegan_code: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "network.pkl"
    write_network_pickle(networks, path)
    # The user forgot PYTHONPATH: the package is neither imported nor importable.
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry != str(stylegan_code)])
    _forget_package()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{PACKAGE}.networks")
    with pytest.raises(ConfigError) as excinfo:
        build_generator(stylegan_config(path), seed=0)
    message = one_line(excinfo)
    assert repr(PACKAGE) in message and "PYTHONPATH" in message and "torch_utils" in message


def test_stylegan_pickle_without_g_ema_or_not_a_pickle_is_refused(networks: ModuleType, tmp_path: Path) -> None:
    module = networks.Generator()
    no_g_ema = tmp_path / "discriminator.pkl"
    with open(no_g_ema, "wb") as handle:
        pickle.dump({"G": module, "D": None}, handle)
    with pytest.raises(ConfigError) as excinfo:
        build_generator(stylegan_config(no_g_ema), seed=0)
    assert "'G_ema'" in one_line(excinfo) and "'D'" in str(excinfo.value)

    not_a_module = tmp_path / "tensor.pkl"
    with open(not_a_module, "wb") as handle:
        pickle.dump({"G_ema": torch.zeros(3)}, handle)
    with pytest.raises(ConfigError, match="not a torch module") as excinfo:
        build_generator(stylegan_config(not_a_module), seed=0)
    one_line(excinfo)

    garbage = tmp_path / "garbage.pkl"
    garbage.write_bytes(b"this is not a pickle\n" * 4)
    with pytest.raises(ConfigError, match="cannot unpickle") as excinfo:
        build_generator(stylegan_config(garbage), seed=0)
    one_line(excinfo)


# --------------------------------------------------------------------------------------------
# torchscript
# --------------------------------------------------------------------------------------------

TS_Z_DIM, TS_W_DIM, TS_RESOLUTION = 6, 10, 8


class TinyScripted(nn.Module):
    """A scriptable generator as the module docstring tells users to export one."""

    def __init__(self, declare_size: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.z_dim = TS_Z_DIM
        self.side = TS_RESOLUTION
        if declare_size:
            self.img_channels = 3
            self.img_resolution = TS_RESOLUTION
        self.to_w = nn.Linear(TS_Z_DIM, TS_W_DIM)
        self.to_pixels = nn.Linear(TS_W_DIM, 3 * TS_RESOLUTION * TS_RESOLUTION)
        stream = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=stream) * 0.5)

    @torch.jit.export
    def mapping(self, z: torch.Tensor) -> torch.Tensor:
        return self.to_w(z)

    @torch.jit.export
    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.to_pixels(w)).view(w.shape[0], 3, self.side, self.side)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.synthesis(self.mapping(z))


class SynthesisOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.z_dim = TS_Z_DIM
        self.to_pixels = nn.Linear(TS_Z_DIM, 3 * 4 * 4)

    @torch.jit.export
    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.to_pixels(w)).view(w.shape[0], 3, 4, 4)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.synthesis(w)


class NoZDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(TS_Z_DIM, TS_Z_DIM)

    @torch.jit.export
    def mapping(self, z: torch.Tensor) -> torch.Tensor:
        return self.layer(z)

    @torch.jit.export
    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return w.view(w.shape[0], 1, 1, -1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.mapping(z)


def save_scripted(module: nn.Module, path: Path) -> Path:
    """torch.jit.script + save (silencing torch's TorchScript deprecation notice in the test log)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def torchscript_config(path: Path, **overrides: object) -> GeneratorConfig:
    fields: dict[str, object] = {"name": "torchscript", "path": str(path), "latent_dim": TS_W_DIM}
    fields.update(overrides)
    return GeneratorConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("declare_size", [True, False], ids=["declared-size", "inferred-size"])
def test_torchscript_latents_and_images(tmp_path: Path, declare_size: bool) -> None:
    reference = TinyScripted(declare_size=declare_size, seed=5)
    path = save_scripted(TinyScripted(declare_size=declare_size, seed=5), tmp_path / "generator.pt")
    generator = build_generator(torchscript_config(path), seed=0)
    assert isinstance(generator, TorchScriptGenerator)
    assert (generator.latent_dim, generator.image_channels, generator.image_resolution) == (TS_W_DIM, 3,
                                                                                            TS_RESOLUTION)
    assert generator.device == torch.device("cpu") and generator.to(torch.device("cpu")) is generator
    assert not any(parameter.requires_grad for parameter in generator.module.parameters())

    latents = generator.sample_latents(4, torch.Generator().manual_seed(3))
    assert latents.shape == (4, TS_W_DIM) and not latents.requires_grad
    z = torch.randn(4, TS_Z_DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(latents, reference.mapping(z))
    torch.testing.assert_close(latents, generator.sample_latents(4, torch.Generator().manual_seed(3)),
                               rtol=0, atol=0)
    assert not torch.allclose(latents, generator.sample_latents(4, torch.Generator().manual_seed(4)))

    images = generator.synthesize(latents)
    assert images.shape == (4, 3, TS_RESOLUTION, TS_RESOLUTION)
    assert images.min() >= -1 and images.max() <= 1
    torch.testing.assert_close(generator.synthesize(latents), images, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(images, reference.synthesis(latents))
    provenance = generator.provenance()
    assert provenance["sha256"] == file_sha256(path) and provenance["latent_dim"] == TS_W_DIM
    assert provenance["resolution"] == TS_RESOLUTION and provenance["z_dim"] == TS_Z_DIM


def test_torchscript_declared_latent_dim_and_sha256(tmp_path: Path) -> None:
    path = save_scripted(TinyScripted(), tmp_path / "generator.pt")
    with pytest.raises(ConfigError) as excinfo:
        build_generator(torchscript_config(path, latent_dim=TS_W_DIM + 1), seed=0)
    assert f"set generator.latent_dim={TS_W_DIM}" in one_line(excinfo)
    digest = file_sha256(path)
    flip_one_byte(path)
    with pytest.raises(ConfigError) as excinfo:
        build_generator(torchscript_config(path, sha256=digest), seed=0)
    assert "sha256" in one_line(excinfo)


def test_torchscript_refuses_a_file_that_is_not_torchscript(tmp_path: Path) -> None:
    state_dict = tmp_path / "state_dict.pt"
    torch.save(TinyScripted().state_dict(), state_dict)
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n" * 10)
    for path in (state_dict, text):
        with pytest.raises(ConfigError) as excinfo:
            build_generator(torchscript_config(path), seed=0)
        message = one_line(excinfo)
        assert "is not a TorchScript file" in message and "torch.jit.save" in message


@pytest.mark.parametrize(("module", "missing"), [(SynthesisOnly, "mapping"), (NoZDim, "z_dim")])
def test_torchscript_refuses_a_module_without_the_interface(tmp_path: Path, module: type[nn.Module],
                                                            missing: str) -> None:
    path = save_scripted(module(), tmp_path / "incomplete.pt")
    with pytest.raises(ConfigError) as excinfo:
        build_generator(torchscript_config(path), seed=0)
    message = one_line(excinfo)
    assert f"lacks {missing}" in message and "@torch.jit.export" in message


# --------------------------------------------------------------------------------------------
# the built-in DCGAN
# --------------------------------------------------------------------------------------------


def test_dcgan_faces_loads_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    real_load = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    generator = build_generator(GeneratorConfig(name="dcgan_faces"), seed=0)
    assert calls and all(call.get("weights_only") is True for call in calls)
    images = generator.synthesize(generator.sample_latents(2, torch.Generator().manual_seed(0)))
    assert images.shape == (2, 3, 64, 64)


def test_dcgan_weights_with_one_changed_byte_are_refused(tmp_path: Path) -> None:
    copy = tmp_path / "weights.tar"
    shutil.copyfile(dcgan.packaged_weights()[0], copy)
    module, digest = dcgan.load_dcgan_weights(str(copy))
    assert digest == dcgan.WEIGHTS_SHA256 and isinstance(module, dcgan.DCGANGenerator)
    flip_one_byte(copy)
    with pytest.raises(ConfigError) as excinfo:
        dcgan.load_dcgan_weights(str(copy))
    assert "sha256" in one_line(excinfo)
