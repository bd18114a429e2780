"""What the prefill and decode nodes share: proto conversions, the asyncio bridge to the engine thread,
load/info answers and the gRPC server bootstrap."""
