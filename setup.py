from setuptools import find_packages, setup

setup(
    name="hvd_dssync",
    version="0.1.0",
    description="DS-Sync (divide-and-shuffle synchronization) as a drop-in Horovod optimizer",
    packages=find_packages(include=["hvd_dssync", "hvd_dssync.*"]),
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"torch": ["torch", "horovod"], "keras": ["tensorflow", "horovod"]},
    entry_points={"console_scripts": ["hvd-dssync=hvd_dssync.__main__:main"]},
)
