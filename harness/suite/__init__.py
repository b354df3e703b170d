"""The backend property suite, importable so users can run it on their own backend:
``pytest --pyargs mla_fuzz.harness.suite --mla-backend=pkg.mod:Class`` (see harness.pytest_plugin)."""
