from references import offline  # noqa: F401 - the session fixture
