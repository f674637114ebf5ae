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
    # tensorboard: optional event files (output.tensorboard); the tests read them back
    extras_require={"test": ["pytest", "tensorboard"], "mpi": ["mpich"], "tensorboard": ["tensorboard"]},
    entry_points={"console_scripts": ["htfl-dist=htfl_dist.main:main"]},
)
