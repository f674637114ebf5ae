from setuptools import find_packages, setup

setup(
    name="htfl_dist",
    version="0.1.0",
    description="Distributed prototype-based heterogeneous federated learning (FedTGP, FedProto, ...)",
    packages=find_packages(include=["htfl_dist", "htfl_dist.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.2", "torchvision>=0.17", "numpy", "pyyaml", "h5py", "mpi4py",
                      "pillow", "scipy",  # pillow: JPEG datasets; scipy: Flowers102's .mat files
                      "matplotlib"],  # learning-curve plots of python -m htfl_dist.report (imported only there)
    # tensorboard: optional event files (output.tensorboard); the tests read them back.
    # opacus: privacy.* (docs/privacy.md) takes its accountants (RDP, PRV), noise calibration and
    # per-sample clipping-and-noise optimizer from it rather than from code of our own;
    # cryptography: the secret noise's ChaCha20 stream (htfl_dist/privacy/noise.py) and secure aggregation's
    # X25519, HKDF and ChaCha20-Poly1305 (htfl_dist/privacy/secagg_crypto.py): audited constant-time primitives
    # ruff, mypy, types-PyYAML: .ci/run's `ruff check .` and `mypy` (mypy.ini), pinned to a minor
    # release so that a new release's rules do not fail CI unannounced; types-PyYAML: yaml's types.
    # setuptools: the tests and .ci/run pip-install the example plugin without build isolation
    # mlflow-skinny (output.mlflow): the tracking client and file store without the server's
    # database, pandas and scikit-learn stack that full mlflow pulls in (~90 MB and 30 s to
    # install against several hundred MB); `mlflow ui` needs full mlflow (docs/running.md).
    # wandb (output.wandb): offline runs by default, ~70 MB. Both in "test": the tests read the
    # runs back through the libraries.
    extras_require={"test": ["pytest", "pytest-xdist", "tensorboard", "ruff~=0.17.6", "mypy~=2.4.1", "types-PyYAML",
                             "setuptools>=61", "mlflow-skinny>=2.12", "wandb>=0.19"],
                    "mpi": ["mpich"], "tensorboard": ["tensorboard"],
                    "mlflow": ["mlflow-skinny>=2.12"], "wandb": ["wandb>=0.19"],
                    "privacy": ["opacus>=1.5", "cryptography>=42"]},
    entry_points={"console_scripts": ["htfl-dist=htfl_dist.main:main"]},
)
