"""A user's script that stops part-way the first time it runs: at step 10 it raises while the
file named by $RESUME_TEST_STOP exists (a bug the user then fixes), so the job gives up;
`unbroken run --resume` must then finish it with the weights of a run that never stopped.
With $RESUME_TEST_PAUSE_S each step sleeps first (a test interrupts the job with Ctrl-C)."""
import os
import time

import torch
import torch.nn as nn

import unbroken

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
trainer = unbroken.Trainer(model, opt, torch.optim.lr_scheduler.StepLR(opt, 4, 0.5))
data = torch.randn(512, 16)
target = data[:, :4].sin()
stop_file = os.environ.get("RESUME_TEST_STOP", "")
pause_s = float(os.environ.get("RESUME_TEST_PAUSE_S", "0"))  # slow steps, so a test can interrupt the job

for step in trainer.steps(16):
    if step == 10 and stop_file and os.path.exists(stop_file):
        raise RuntimeError("a bug at step 10 (the test's stop file exists)")
    time.sleep(pause_s)
    idx = torch.randint(0, 512, (8,))
    trainer.step(lambda: nn.functional.mse_loss(model(data[idx]), target[idx]))
trainer.finish()
