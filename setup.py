from setuptools import find_packages, setup

setup(
    name="meshnet",
    version="0.1.0",
    description="Run one GGUF language model across several processes and hosts, a layer range each",
    packages=find_packages(include=["meshnet", "meshnet.*"]),
    package_data={"meshnet.serve": ["console/*.html", "console/*.js", "console/*.css"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        "cffi>=1.15",
        "pyzmq>=25",
        "msgpack>=1.0",
        "click>=8.1",
        "gguf>=0.10",
        # meshnet serve: the ASGI stack llama-cpp-python's and vLLM's servers use
        "fastapi>=0.110",
        "uvicorn>=0.29",
        # LAN discovery of a coordinator by mDNS/DNS-SD (meshnet.net.discovery), not hand-made multicast
        "zeroconf>=0.130",
        # --model hf:ORG/REPO: the hub's own client (its cache, its auth, resumed downloads)
        "huggingface_hub>=0.30",
    ],
    # the real OpenAI client and an agent framework's against meshnet serve; a real terminal
    # for meshnet chat; a real browser (Debian's chromium) driving the console
    # the Ollama and Anthropic clients against its other APIs; the agent frameworks people
    # point at an OpenAI server (LangChain, pydantic-ai, the llm CLI)
    extras_require={"test": ["pytest>=7", "jsonschema>=4", "openai>=1.30", "pexpect>=4.8", "openai-agents>=0.24",
                             "selenium>=4.20", "ollama>=0.4", "anthropic>=0.40", "langchain-openai>=0.3",
                             "pydantic-ai-slim[openai]>=1.0", "llm>=0.26"]},
    entry_points={"console_scripts": ["meshnet=meshnet.cli.main:main"]},
)
