pytest_plugins = ["fixtures_postgres"]
