"""The Open Inference Protocol's gRPC messages: the .proto, its compiled descriptor and the message classes."""
