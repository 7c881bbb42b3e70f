from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style LLM pretraining: TP, PP, DP, CP and EP as flags; runs on CPU too.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megalite", "megalite.*"]),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        # megatron-core is the oracle of the Megatron parity tests (CPU: its wheel ships the
        # compiled dataset helpers; launch/setup_env.sh installs it with --no-deps first)
        "test": ["pytest>=7", "transformers>=4.40", "matplotlib", "tokenizers", "tiktoken",
                 "megatron-core", "einops",
                 # the etcd rendezvous' client (tests/e2e/test_etcd_rendezvous_e2e.py)
                 "python-etcd"],
        # --rdzv-backend etcd-v2 (megalite.elastic.launch; docs/fault_tolerance.md)
        "etcd": ["python-etcd"],
        # --tokenizer-type TikTokenizer / Llama3Tokenizer
        "tiktoken": ["tiktoken"],
        "te": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
    },
    entry_points={"console_scripts": ["megalite=megalite.cli.main:main"]},
)
