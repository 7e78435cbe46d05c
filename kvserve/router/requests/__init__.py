"""A request's life in the router: the pipeline, dispatch, migrations, drains, output ordering and muxing."""
