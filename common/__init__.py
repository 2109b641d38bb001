"""Code shared by the client and the services: the tensor codec and the error model. No torch here."""
