"""Online training: the draft trains on hidden states the target makes while it trains, with no
capture on disk. A source (sources.py) hands the trainer, sample by sample in its data loader's
order, exactly what a capture would have stored; the vLLM producers (trainer/vllm/online.py)
reach every trainer rank through the run's Ray channel (channel.py; the samples as
trainer/data/wire.py encodes them); run.py sets it up for each rank.
"""
