"""End to end: vLLM engines and servers, Dynamo, the demo, the fault campaign, multi-process G4 and clusters."""
