"""The router's served surfaces: the gRPC servicer and its Ray actor, the OpenAI HTTP API, admin, health."""
