"""`kiln serve`: engines behind the Open Inference Protocol (KServe v2) over HTTP (FastAPI/uvicorn, with Triton's
binary-data extension) and gRPC (grpcio), with dynamic batching, execution-context instances and Prometheus
metrics in Triton's names. The HTTP app (`http_app.create_app`) is self-contained, so Ray Serve can mount it."""
