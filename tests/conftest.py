pytest_plugins = ["fixtures_postgres", "fixtures_stack"]
