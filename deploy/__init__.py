"""Ways to run Temper on a cluster, outside the services' own code: ray_cluster.py puts trainers and
samplers on Ray as actors (`python -m temper.deploy`)."""
