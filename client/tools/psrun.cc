// psrun: a torchrun-style launcher. Starts a local psd (one daemon, or a cluster of shards on
// 127.0.0.1), waits until it serves, then starts N copies of any trainer command with the
// environment contract (PSD_CLUSTER, PSD_WORKER_INDEX, PSD_NUM_WORKERS, PSD_WORKER_NAME,
// PSD_CHIEF_ELIGIBLE, PSD_AUTH_TOKEN_FILE), streams every process's output line by line with a
// prefix ("[psd 0] ...", "[worker 2] ..."), stops everything on Ctrl-C, SIGTERM, --timeout-s or
// a failing worker, and exits with the workers' status.
//
//   psrun --shards 2 --workers 4 --replicas 3 -- python3 train.py --epochs 3
//   psrun --workers 2 --psd-arg=--learning-rate=0.5 --auth auto -- ./my_trainer
//   psrun --cluster 10.0.0.1:7070,10.0.0.2:7070 --workers 8 -- ./my_trainer   # a running cluster
//
// Everything after the first `--` is the trainer's command, untouched (it may contain `--`
// itself); psd flags go one per --psd-arg (`--psd-arg=--slice-bytes=4096`).
//
// Processes: every child runs in its own process group (its own subprocesses are stopped with
// it; Ctrl-C at the terminal reaches only psrun, which stops the children in order). psrun
// signals only the process groups of the children it started: SIGTERM, then SIGKILL after
// --grace-s. If psrun itself is killed outright, its children get SIGTERM (PR_SET_PDEATHSIG). Single-threaded: one poll
// loop over the children's pipes and a self-pipe that the signal handlers write to.
//
// Ports: psrun binds each shard's listening socket itself on 127.0.0.1 port 0 (the kernel picks
// free ports; nothing is guessed, nothing can clash) and hands it to the shard as descriptor 3
// (`psd --listen-fd 3`); the cluster list is made of the ports it got.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "psclient/client.h"
#include "psrun_launcher.h"

using namespace psrun;  // NOLINT: the launcher this command line drives

int main(int argc, char** argv) {
  // Everything after the first "--" is the trainer's command, kept as is.
  std::vector<std::string> command;
  int own = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      own = i;
      command.assign(argv + i + 1, argv + argc);
      break;
    }
  }
  CLI::App app{
      "psrun: start a local psd (one daemon or a cluster of shards) and N copies of a trainer with the "
      "environment contract PSD_CLUSTER, PSD_WORKER_INDEX, PSD_NUM_WORKERS, PSD_WORKER_NAME, PSD_CHIEF_ELIGIBLE, "
      "PSD_AUTH_TOKEN_FILE; stream their output; stop everything on Ctrl-C or a failure; exit with the workers' "
      "status.\n\n  psrun [options] -- COMMAND [ARGS...]"};
  Options o;
  auto* shards = app.add_option("--shards", o.shards, "psd processes: 1 = one daemon, more = a cluster on 127.0.0.1")
                     ->check(CLI::Range(1, 256))
                     ->capture_default_str();
  app.add_option("--workers", o.workers, "copies of the command to start")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--replicas", o.replicas,
                 "psd -R: gradients that complete a step (default: every worker; with --backup B, --workers - B)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--backup", o.backup,
                 "psd -B: backup replicas, psd admits --replicas + B workers (default: none, psd -N = --workers)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--psd", o.psd, "the psd binary (default: next to psrun, or ../server/psd in a build tree)");
  app.add_option("--psd-arg", o.psd_args,
                 "one more psd flag, repeatable: --psd-arg=--learning-rate=0.5 (--init-tokens overrides psrun's 0)")
      ->allow_extra_args(false);
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "psd --checkpoint-dir (every shard; a rerun resumes)");
  auto* token = app.add_option("--auth-token-file", o.auth_token_file,
                               "a shared secret for psd and the workers (PSD_AUTH_TOKEN_FILE)");
  app.add_option("--auth", o.auth, "auto: a fresh random secret for this run, in a 0600 file")
      ->check(CLI::IsMember({"auto"}))
      ->excludes(token);
  app.add_option("--tls-dir", o.tls_dir,
                 "TLS for psd and the workers: a directory with ca.pem, server.pem, server.key (and client.pem, "
                 "client.key for mutual TLS), as deploy/make_tls_certs.sh DIR makes them");
  app.add_option("--cluster", o.cluster, "start no psd: the workers join this running cluster (host:port,...)")
      ->excludes(shards);
  app.add_option("--on-failure", o.on_failure, "a failing worker: stop everything, or let the others go on")
      ->check(CLI::IsMember({"stop", "continue"}))
      ->capture_default_str();
  app.add_option("--timeout-s", o.timeout_s, "stop everything after this many seconds (0: no limit; exit 124)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--start-timeout-s", o.start_timeout_s, "wait this long for psd to serve (a restore counts)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--grace-s", o.grace_s, "seconds between SIGTERM and SIGKILL when stopping")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--restart-shards", o.restart_shards,
                 "start a psd shard that dies (killed, or failed) again on its port, up to N times each; with "
                 "--psd-arg=--replicas-per-shard=2 it catches up from the copy the next shard keeps")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--shard-exit-s", o.shard_exit_s, "after the workers, wait this long for psd to exit by itself")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-dir", o.log_dir, "also write each process's output to DIR/psd-K.log, DIR/worker-I.log");
  app.footer(
      "Everything after the first -- is the command (it may contain -- itself). Exit status: 0 when every "
      "worker exited 0; else the first failing worker's (or shard's) status, 128+signal for a signal, 124 "
      "after --timeout-s, 1 when psd did not start, 2 for bad arguments.");
  try {
    app.parse(own, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (command.empty()) {
    std::fprintf(stderr, "psrun: no command: psrun [options] -- COMMAND [ARGS...] (see --help)\n");
    return 2;
  }
  for (const auto& a : o.psd_args) {
    for (const char* owned : {"--replicas-to-aggregate", "-R", "--backup-replicas", "-B", "--total-replicas", "-N",
                              "--cluster", "--cluster-file", "--shard-index", "--port", "--port-file", "--host",
                              "--listen-fd", "--auth-token-file", "--cluster-secret-file"}) {
      std::string flag = a.substr(0, a.find('='));
      if (flag == owned) {
        std::fprintf(stderr,
                     "psrun: --psd-arg %s: psrun sets this psd flag itself; use psrun's --replicas, --backup, "
                     "--workers or --auth-token-file (the workers need the token too; a cluster gets a fresh "
                     "--cluster-secret-file)\n",
                     a.c_str());
        return 2;
      }
    }
  }
  if (!o.cluster.empty()) {
    if (psclient::ParseClusterList(o.cluster).empty()) {
      std::fprintf(stderr, "psrun: --cluster '%s' lists no host:port\n", o.cluster.c_str());
      return 2;
    }
    o.shards = 0;
  }
  if (o.replicas < 0) {
    // psd admits R + B workers and waits for them all: with --backup alone, R = W - B keeps that
    // W (R = W would have psd wait for B workers psrun never starts).
    if (o.backup > 0 && o.backup >= o.workers) {
      std::fprintf(stderr,
                   "psrun: --backup %d needs more --workers than that (got %d): the step takes --workers - "
                   "--backup gradients; raise --workers or lower --backup\n",
                   o.backup, o.workers);
      return 2;
    }
    o.replicas = o.workers - std::max(o.backup, 0);
  }
  o.command = std::move(command);

  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("psrun: pipe");
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  Launcher launcher(std::move(o));
  return launcher.Run();
}
