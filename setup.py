"""Packaging for elastic_ext. The development environment (Horovod build
included) is made by tools/setup.sh; this file declares the package and
the ranges it was tested with."""

from setuptools import find_packages, setup

setup(
    name="elastic_ext",
    version="0.1.0",
    description="Fault-tolerant Horovod elastic training for PyTorch and TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["elastic_ext", "elastic_ext.*"]),
    # Horovod is not listed: 0.28.1 must be built from source against the
    # installed frameworks (tools/setup.sh does it, see README).
    # The ranges cover both tested stacks (docs/environment.md): "previous"
    # (numpy 1.26, torch 2.13, TF 2.17) and "current" (numpy 2.5, torch 2.15, TF 2.21).
    install_requires=["numpy>=1.24,<3", "xxhash>=3.0,<5"],
    extras_require={
        "torch": ["torch>=2.1,<2.16"],
        # tf_keras requires the `tensorflow` package itself (tensorflow-cpu
        # alone does not satisfy it), so that is the one named here.
        "tensorflow": ["tensorflow>=2.15,<2.22", "tf_keras>=2.15,<2.22"],
        "aws": ["boto3>=1.28"],
        "slurm": ["python-hostlist>=1.23,<3"],
        "test": ["pytest>=7.4", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "hypothesis>=6.80", "psutil>=5.9",
                 "moto[server,ec2,autoscaling]>=5.0,<6", "matplotlib>=3.7"],
    },
    # The same commands as host_discovery/*.py (which run from a checkout).
    entry_points={
        "console_scripts": [
            "elastic-horovodrun = elastic_ext.launch.horovodrun:main",
            "elastic-ext-discover-slurm = elastic_ext.discovery.commands:slurm_main",
            "elastic-ext-discover-aws-spot = elastic_ext.discovery.commands:aws_main",
            "elastic-ext-discover-static = elastic_ext.discovery.commands:static_main",
        ],
    },
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
