"""The public API: the gRPC servicer and its verbs (the top layer; builds on planning, workers, tenancy, db)."""
