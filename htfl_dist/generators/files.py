"""User-supplied generators loaded from a file: ``stylegan_pickle`` and ``torchscript``.

Both are frozen on the CPU after loading, and both declare their latent width H in
``generator.latent_dim`` so that client ranks never have to open the file (the registry checks
the declared H against the loaded one on rank 0).

``stylegan_pickle``: a StyleGAN2-ADA-PyTorch / StyleGAN3 / StyleGAN-XL network pickle as
NVIDIA's training code writes it (a pickled dict whose ``"G_ema"`` is the generator module). A
pickle runs code when it is loaded, so it is refused unless ``generator.trust_pickle=true``, and
the StyleGAN code that wrote it (``torch_utils``, ``dnnlib``, its network modules) must be on
PYTHONPATH because the pickle references those classes. Valid latents are the first row of the
mapping network's output w = mapping(z, c, ψ), z ~ N(0, I); a conditional network (``c_dim`` > 0)
gets uniformly random one-hot classes, as FedKTL's reference code does for StyleGAN-XL. Synthesis
broadcasts w to every layer and uses ``noise_mode="const"`` so that it is deterministic::

    generator.name=stylegan_pickle generator.path=network.pkl generator.latent_dim=512 \\
    generator.trust_pickle=true [generator.sha256=...] [generator.truncation=0.7]

``torchscript``: a TorchScript file (no pickle, no code of yours on PYTHONPATH) exposing the two
methods ``mapping(z) -> w [n, H]`` and ``synthesis(w) -> images [n, C, R, R]`` in [−1, 1], and an
int attribute ``z_dim``; optional int attributes ``img_channels`` and ``img_resolution`` (else
they are read off one synthesised image). Export one like this::

    import torch
    from torch import nn

    class Exported(nn.Module):
        def __init__(self, decoder: nn.Module, z_dim: int) -> None:
            super().__init__()
            self.decoder = decoder      # your frozen generator: [n, z_dim] -> [n, 3, 64, 64] in [-1, 1]
            self.z_dim = z_dim          # a plain int attribute (required)
            self.img_channels = 3       # optional
            self.img_resolution = 64    # optional

        @torch.jit.export
        def mapping(self, z: torch.Tensor) -> torch.Tensor:
            return z                    # a prior-latent decoder: its valid latents are z itself

        @torch.jit.export
        def synthesis(self, w: torch.Tensor) -> torch.Tensor:
            return self.decoder(w)

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.synthesis(self.mapping(z))

    torch.jit.save(torch.jit.script(Exported(decoder, 100).eval()), "generator.pt")

and run with ``generator.name=torchscript generator.path=generator.pt generator.latent_dim=100``.
For a style-based generator, ``mapping`` returns one w row [n, H] and ``synthesis`` broadcasts it
to the layers itself.
"""
from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from htfl_dist.errors import ConfigError
from htfl_dist.generators.base import GeneratorConfig, LatentGenerator, check_generator_output
from htfl_dist.generators.registry import checked_file, frozen, register_generator

STYLEGAN = "stylegan_pickle"
TORCHSCRIPT = "torchscript"
STYLEGAN_ATTRIBUTES = ("z_dim", "c_dim", "w_dim", "num_ws", "img_channels", "img_resolution")
PROBE_SEED = 0
"""Seed of the one z used to read a TorchScript generator's H (and image size) off its outputs."""


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` — keeps a user-facing ConfigError on one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _int_attribute(module: Any, name: str, what: str, minimum: int) -> int:
    """``module.name`` as an int ≥ ``minimum``; one line naming the attribute otherwise."""
    value = getattr(module, name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}: attribute {name!r} must be an int >= {minimum}, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# StyleGAN network pickles
# --------------------------------------------------------------------------------------------


class StyleGANPickleGenerator(LatentGenerator):
    """A StyleGAN ``G_ema``: latents are w = mapping(z, c, ψ)[:, 0] (H = ``w_dim``), synthesis
    broadcasts w to all ``num_ws`` layers with constant noise (deterministic)."""

    def __init__(self, module: nn.Module, *, truncation: float = 1.0, source: dict[str, Any] | None = None) -> None:
        """``source``: where the module came from (path, sha256), prepended to ``provenance()``."""
        what = f"generator {STYLEGAN}"
        self.name = STYLEGAN
        # NVIDIA's network, unpickled from its own code: its parts (mapping, synthesis) have no types here
        self.module: Any = frozen(module)
        self.z_dim = _int_attribute(module, "z_dim", what, 1)
        self.c_dim = _int_attribute(module, "c_dim", what, 0)
        self.w_dim = _int_attribute(module, "w_dim", what, 1)
        self.num_ws = _int_attribute(module, "num_ws", what, 1)
        self.latent_dim = self.w_dim
        self.image_channels = _int_attribute(module, "img_channels", what, 1)
        self.image_resolution = _int_attribute(module, "img_resolution", what, 1)
        self.truncation = float(truncation)
        self._source = dict(source or {})

    @torch.no_grad()
    def sample_latents(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """z ~ N(0, I) (then, if conditional, uniform one-hot classes) from ``generator`` on the
        CPU, so the draws do not depend on the device; w = first row of the mapping output."""
        z = torch.randn(count, self.z_dim, generator=generator, device="cpu")
        labels = torch.zeros(count, self.c_dim)
        if self.c_dim > 0:
            classes = torch.randint(self.c_dim, (count,), generator=generator, device="cpu")
            labels = nn.functional.one_hot(classes, self.c_dim).to(torch.float32)
        device = self.device
        ws = self.module.mapping(z.to(device), labels.to(device), truncation_psi=self.truncation)
        expected = (count, self.num_ws, self.w_dim)
        if not isinstance(ws, torch.Tensor) or tuple(ws.shape) != expected:
            shape = tuple(ws.shape) if isinstance(ws, torch.Tensor) else type(ws).__name__
            raise ConfigError(f"generator {STYLEGAN}: G_ema.mapping returned {shape}, expected ws of shape "
                              f"{expected} [n, num_ws, w_dim]")
        return ws[:, 0, :].to(torch.float32)

    @torch.no_grad()
    def synthesize(self, latents: torch.Tensor) -> torch.Tensor:
        """w [n, H] → the same w at every layer → images, clamped to [−1, 1] (StyleGAN's output
        is not bounded; NVIDIA's own scripts clamp when converting to pixels)."""
        ws = latents.to(self.device, torch.float32).unsqueeze(1).repeat(1, self.num_ws, 1)
        images = self.module.synthesis(ws, noise_mode="const")
        if not isinstance(images, torch.Tensor):
            raise ConfigError(f"generator {STYLEGAN}: G_ema.synthesis returned {type(images).__name__}, "
                              f"expected an image tensor")
        check_generator_output(self.name, images, latents.shape[0], self.image_channels, self.image_resolution)
        return images.to(torch.float32).clamp(-1, 1)

    def provenance(self) -> dict[str, Any]:
        return {"name": self.name, **self._source, "z_dim": self.z_dim, "c_dim": self.c_dim, "w_dim": self.w_dim,
                "num_ws": self.num_ws, "channels": self.image_channels, "resolution": self.image_resolution,
                "parameters": _parameter_count(self.module), "truncation": self.truncation}


def load_stylegan_pickle(path: str | Path) -> nn.Module:
    """``G_ema`` from a network pickle; every failure is one line saying what to fix.

    ``pickle.load`` rather than ``torch.load``: NVIDIA writes these files with ``pickle.dump``
    (not ``torch.save``), so ``torch.load`` cannot read them, and ``weights_only=True`` could not
    rebuild a module anyway. The caller has already required ``generator.trust_pickle=true``
    and checked the sha256."""
    what = f"generator {STYLEGAN}"
    try:
        with open(path, "rb") as handle:
            data = pickle.load(handle)  # trusted: generator.trust_pickle=true
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{what}: unpickling {str(path)!r} needs the Python module {exc.name!r}; put the "
                          f"StyleGAN code that wrote the pickle (the repository with 'torch_utils' and 'dnnlib') "
                          f"on PYTHONPATH and install its requirements") from None
    except Exception as exc:  # any unreadable pickle is the same user-facing problem
        raise ConfigError(f"{what}: cannot unpickle {str(path)!r} ({_first_line(exc)}); is it a StyleGAN network "
                          f"pickle, and is the StyleGAN code that wrote it on PYTHONPATH?") from None
    if not isinstance(data, dict) or "G_ema" not in data:
        found = f"keys {sorted(map(str, data))}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise ConfigError(f"{what}: {str(path)!r} holds {found}, not a StyleGAN network pickle with 'G_ema'")
    module = data["G_ema"]
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{what}: 'G_ema' in {str(path)!r} is a {type(module).__name__}, not a torch module")
    missing = [name for name in (*STYLEGAN_ATTRIBUTES, "mapping", "synthesis") if not hasattr(module, name)]
    if missing:
        raise ConfigError(f"{what}: 'G_ema' in {str(path)!r} lacks {', '.join(missing)}; expected a StyleGAN2/3/XL "
                          f"generator (z_dim, c_dim, w_dim, num_ws, img_channels, img_resolution, mapping, "
                          f"synthesis)")
    return module


def build_stylegan_pickle(config: GeneratorConfig, seed: int) -> LatentGenerator:
    """Refuse before touching the file unless the user said they trust it; then sha256, then load."""
    if not config.trust_pickle:
        raise ConfigError(f"generator.name={STYLEGAN} loads a pickle, which can run arbitrary code when opened; "
                          f"set generator.trust_pickle=true only for a file you trust (and pin generator.sha256)")
    if not config.path:
        raise ConfigError(f"generator.name={STYLEGAN} needs generator.path=FILE")
    file, digest = checked_file(config.path, config.sha256, f"generator {STYLEGAN}")
    return StyleGANPickleGenerator(load_stylegan_pickle(file), truncation=config.truncation,
                                   source={"path": str(file), "sha256": digest})


# --------------------------------------------------------------------------------------------
# TorchScript files
# --------------------------------------------------------------------------------------------


class TorchScriptGenerator(LatentGenerator):
    """A scripted module with ``mapping(z) -> w`` and ``synthesis(w) -> images``; latents are
    mapping(z), z ~ N(0, I_{z_dim}); H and (when not declared) the image size are read off one
    probe through the network, so a user never has to state them twice."""

    def __init__(self, module: torch.jit.ScriptModule, *, source: dict[str, Any] | None = None) -> None:
        """``source``: where the module came from (path, sha256), prepended to ``provenance()``."""
        what = f"generator {TORCHSCRIPT}"
        self.name = TORCHSCRIPT
        self.module = frozen(module)
        missing = [name for name in ("mapping", "synthesis", "z_dim") if not hasattr(module, name)]
        if missing:
            raise ConfigError(f"{what}: the TorchScript module lacks {', '.join(missing)}; export it with "
                              f"@torch.jit.export methods mapping(z) and synthesis(w) and an int attribute z_dim "
                              f"(see htfl_dist/generators/files.py)")
        self.z_dim = _int_attribute(module, "z_dim", what, 1)
        probe = torch.randn(1, self.z_dim, generator=torch.Generator().manual_seed(PROBE_SEED))
        with torch.no_grad():
            latent = self._call("mapping", probe)
            if latent.dim() != 2 or latent.shape[0] != 1:
                raise ConfigError(f"{what}: mapping(z [1, {self.z_dim}]) returned shape {tuple(latent.shape)}, "
                                  f"expected [1, H]")
            self.latent_dim = int(latent.shape[1])
            if hasattr(module, "img_channels") and hasattr(module, "img_resolution"):
                self.image_channels = _int_attribute(module, "img_channels", what, 1)
                self.image_resolution = _int_attribute(module, "img_resolution", what, 1)
            else:
                image = self._call("synthesis", latent)
                if image.dim() != 4 or image.shape[0] != 1 or image.shape[2] != image.shape[3]:
                    raise ConfigError(f"{what}: synthesis(w [1, {self.latent_dim}]) returned shape "
                                      f"{tuple(image.shape)}, expected square images [1, C, R, R]")
                self.image_channels, self.image_resolution = int(image.shape[1]), int(image.shape[2])
        self._source = dict(source or {})

    def _call(self, method: str, inputs: torch.Tensor) -> torch.Tensor:
        """One of the user's methods; its failure (or a non-tensor result) becomes one line."""
        try:
            result = getattr(self.module, method)(inputs)
        except Exception as exc:  # the user's exported code failed on a valid input
            raise ConfigError(f"generator {TORCHSCRIPT}: {method}(tensor of shape {tuple(inputs.shape)}) failed "
                              f"({_first_line(exc)})") from None
        if not isinstance(result, torch.Tensor):
            raise ConfigError(f"generator {TORCHSCRIPT}: {method} returned {type(result).__name__}, expected a tensor")
        return result

    @torch.no_grad()
    def sample_latents(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """z ~ N(0, I) from ``generator`` on the CPU (device-independent draws), then mapping."""
        z = torch.randn(count, self.z_dim, generator=generator, device="cpu").to(self.device)
        latents = self._call("mapping", z)
        if tuple(latents.shape) != (count, self.latent_dim):
            raise ConfigError(f"generator {TORCHSCRIPT}: mapping returned shape {tuple(latents.shape)}, "
                              f"expected {(count, self.latent_dim)}")
        return latents.to(torch.float32)

    @torch.no_grad()
    def synthesize(self, latents: torch.Tensor) -> torch.Tensor:
        images = self._call("synthesis", latents.to(self.device, torch.float32))
        check_generator_output(self.name, images, latents.shape[0], self.image_channels, self.image_resolution)
        return images.to(torch.float32)

    def provenance(self) -> dict[str, Any]:
        return {"name": self.name, **self._source, "z_dim": self.z_dim, "latent_dim": self.latent_dim,
                "channels": self.image_channels, "resolution": self.image_resolution,
                "parameters": _parameter_count(self.module)}


def load_torchscript(path: str | Path) -> torch.jit.ScriptModule:
    """``torch.jit.load`` on the CPU; anything that is not TorchScript is one line.

    TorchScript is deprecated upstream and ``torch.jit.load`` warns about it; the user chose the
    format, so that one FutureWarning is silenced here rather than printed on every run."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)
            return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # any unreadable file is the same user-facing problem
        raise ConfigError(f"generator {TORCHSCRIPT}: {str(path)!r} is not a TorchScript file ({_first_line(exc, 80)}); "
                          f"save one with torch.jit.save(torch.jit.script(module), path)") from None


def build_torchscript(config: GeneratorConfig, seed: int) -> LatentGenerator:
    """sha256 (when pinned) before loading; no trust flag: unlike a pickle, loading TorchScript does not
    execute Python code from the file."""
    if not config.path:
        raise ConfigError(f"generator.name={TORCHSCRIPT} needs generator.path=FILE")
    file, digest = checked_file(config.path, config.sha256, f"generator {TORCHSCRIPT}")
    return TorchScriptGenerator(load_torchscript(file), source={"path": str(file), "sha256": digest})


register_generator(STYLEGAN, build=build_stylegan_pickle, latent_dim=lambda config: config.latent_dim,
                   needs_path=True,
                   summary="a StyleGAN2/3/XL network pickle (G_ema; StyleGAN code on PYTHONPATH; trust_pickle=true)")
register_generator(TORCHSCRIPT, build=build_torchscript, latent_dim=lambda config: config.latent_dim,
                   needs_path=True, summary="a TorchScript file with mapping(z) -> w and synthesis(w) -> images")
