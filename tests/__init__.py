"""The kvblend test suite, importable as the package ``tests`` (helpers: ``from tests.factories
import make_kv``, ``from tests.cluster.vllm.helpers import generate``).

pytest runs with ``--import-mode=importlib`` and ``pythonpath = ["."]`` (pyproject.toml): it
never puts a test directory on ``sys.path``, so ``tests/cluster/`` cannot shadow the ``cluster``
package and two test files may share a basename. Only this ``__init__.py`` exists under
``tests/``: the subdirectories are namespace packages of it, and none of them gets an
``__init__.py`` named like one of our packages (``tests/cluster/__init__.py`` would make any
``sys.path`` entry of ``tests/`` shadow the real ``cluster``).
"""
