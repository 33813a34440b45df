"""A laptop has no CuPy: first on PYTHONPATH, this makes ``import cupy`` fail as it does there, also where CuPy is
installed (the GPU machine), so the docs' blocks are run as a laptop runs them (tests/test_docs.py)."""

raise ModuleNotFoundError("No module named 'cupy'", name="cupy")
