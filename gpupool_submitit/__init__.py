"""submitit's gpupool cluster: `submitit.AutoExecutor(folder, cluster="gpupool")` submits each call
as a gpupool job (executor.py), follows it as a submitit Job (job.py), maps submitit's parameter
names to gpupool's (parameters.py), and inside the job runs the call with submitit's
checkpoint-and-requeue protocol wired to the pool's stop signal and checkpoints (in_job.py)."""
