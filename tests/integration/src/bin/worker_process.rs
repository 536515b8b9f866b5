//! One worker process of the several-processes test (`tests/it/postgres/processes.rs`): the shared
//! `outbox-worker-process` (benches/worker-process), the same process `outbox-lab processes`
//! measures. The test starts it with `--queue work --concurrency 2 --record-as <process>
//! --work-ms 5`: every run is recorded in `<table>_runs` with its process number, and a
//! little work gives every process a share.

fn main() -> std::process::ExitCode {
    outbox_worker_process::main()
}
