"""The backend property suite, importable so users can run it on their own backend:
``pytest --pyargs harness.suite --mla-backend=pkg.mod:Class`` (see harness.pytest_plugin)."""
