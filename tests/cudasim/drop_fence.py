"""Train two ranks on the simulator with one of the GPU path's orderings taken out, and print what the
stream checker (streams.py) says: the evidence that it finds a missing fence in the real training code.

    python tests/cudasim/run.py tests/cudasim/drop_fence.py FENCE COMM [ZERO]
        (FENCE: none, bucket, finish, post; COMM: local, nccl; ZERO: --zero's stage, 0 unless given)

- bucket: the communication thread no longer makes its stream wait for the compute stream's event
  before reducing a bucket (ddp._serve's `ops.wait(computed)`);
- finish: the compute stream no longer waits for the communication stream's last event before
  clipping and AdamW read the reduced gradients (BucketedGradSync.finish's `ops.wait`);
- at --zero 2 and 3, bucket and finish take out the same two orderings of ZeRO's communication thread
  (parallel/zero.py's _serve_calls waits for the call's compute fence; its wait and drain make the compute
  stream wait for the thread's fence before the rank reads a gathered unit or drops a reduced one);
- post: the in-process communicator no longer waits for a rank's stream before its peers read the
  buffer it posts (comm/local.py's `_sync_device`).

COMM local: two virtual ranks on one simulated GPU; nccl: one rank on each of two (the fake NCCL). It
prints `trained` or the error that ended the run, and exits 0 either way.
"""

import os
import sys
import threading

from xtrain_dist.backend.cuda import ops as cuda_ops
from xtrain_dist.comm import local
from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.train.job import train


def main(fence: str, comm: str, zero: str = "0") -> None:
    wait = cuda_ops.CudaBackend.wait

    def wait_unless(in_comm_thread: bool):
        def patched(self, event):
            if threading.current_thread().name.endswith(("-comm", "-zero")) != in_comm_thread:
                wait(self, event)
        return patched

    if fence == "bucket":
        cuda_ops.CudaBackend.wait = wait_unless(in_comm_thread=True)
    elif fence == "finish":
        cuda_ops.CudaBackend.wait = wait_unless(in_comm_thread=False)
    elif fence == "post":
        local._sync_device = lambda buf: None
    elif fence != "none":
        sys.exit(f"unknown fence {fence!r}")
    if comm == "nccl":  # a simulated GPU per rank (read when the ranks pick their devices)
        os.environ["XTRAIN_CUDASIM_DEVICES"] = "2"
    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    cfg = TrainConfig(steps=2, batch=4, seq=32, model="tiny", backend="cuda", world_size=2, comm=comm,
                      grad_sync="bucketed", eval_batches=0, zero=int(zero),
                      **({} if int(zero) >= 2 else {"bucket_mb": 0.05})).resolved()
    try:
        train(cfg, corpus, log=lambda line: None)
        print("trained")
    except Exception as e:
        print(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
