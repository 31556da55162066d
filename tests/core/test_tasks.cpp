// Training data (src/tasks): reference-stream generators, the query-LM teachers (Jordan-RoPE and
// the PJ-RoPE synthetic bridge), LM windows, byte and char corpora, and the SMF reader / MIDI
// tokeniser. Expected streams were produced once with the reference's own code paths (torch 2.15
// CPU generator, CPython's random, pretty_midi 0.2.11 over mido 1.3.3) and are spelled out here; no
// file of shared/data is needed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/types.hpp"
#include "tasks/corpus.hpp"
#include "tasks/midi.hpp"
#include "tasks/midi_text.hpp"
#include "tasks/pj_query_lm.hpp"
#include "tasks/query_lm.hpp"
#include "tasks/rng.hpp"
#include "tasks/text_lm.hpp"

using namespace relpos;
using namespace relpos::tasks;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("relpos-tasks-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& bytes) const {
    const fs::path p = path / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
};

// The message of the InputError `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// ---- SMF building blocks (as the MIDI spec writes them) ----
using Bytes = std::string;
Bytes vlq(uint32_t v) {
  Bytes out(1, static_cast<char>(v & 0x7F));
  while (v >>= 7) out.insert(out.begin(), static_cast<char>(0x80 | (v & 0x7F)));
  return out;
}
Bytes be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}
Bytes be16(uint16_t v) {
  return {static_cast<char>(v >> 8), static_cast<char>(v)};
}
Bytes raw(std::initializer_list<int> b) {
  Bytes s;
  for (int v : b) s.push_back(static_cast<char>(v));
  return s;
}
struct Ev {
  uint32_t tick;
  Bytes bytes;
};
// An MTrk chunk from absolute-tick events, closed by end-of-track.
Bytes track(const std::vector<Ev>& evs, bool end_of_track = true) {
  Bytes body;
  uint32_t last = 0;
  for (const Ev& e : evs) {
    body += vlq(e.tick - last) + e.bytes;
    last = e.tick;
  }
  if (end_of_track) body += raw({0x00, 0xFF, 0x2F, 0x00});
  return "MTrk" + be32(static_cast<uint32_t>(body.size())) + body;
}
Bytes smf(uint16_t format, int16_t division, const std::vector<Bytes>& tracks) {
  Bytes s = "MThd" + be32(6) + be16(format) + be16(static_cast<uint16_t>(tracks.size())) +
            be16(static_cast<uint16_t>(division));
  for (const Bytes& t : tracks) s += t;
  return s;
}
std::vector<int32_t> tokens_of(const Bytes& b, const std::string& name = "test.mid") {
  return tokenize_midi({reinterpret_cast<const uint8_t*>(b.data()), b.size()}, name);
}
// One note of pitch `p`: on at tick 0, off at tick 480 (0.5 s at the default 120 bpm, res 480).
Bytes one_note(int p) {
  return smf(0, 480, {track({{0, raw({0x90, p, 100})}, {480, raw({0x80, p, 0})}})});
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Reference random streams

TEST(TaskRng, TorchCpuGeneratorMatchesTorch) {
  // torch.randint(0, 1000, (2, 3), generator=g) with g.manual_seed(1701): [[814, 492, 390], [558,
  // 250, 251]]
  TorchCpuGenerator g(1701);
  for (int64_t want : {814, 492, 390, 558, 250, 251}) EXPECT_EQ(g.randint(0, 1000), want);
  TorchCpuGenerator bits(1701);  // torch.randint(0, 2, (1, 10))
  for (int64_t want : {0, 0, 0, 0, 0, 1, 1, 1, 0, 0}) EXPECT_EQ(bits.randint(0, 2), want);
  TorchCpuGenerator b(5);  // torch.bernoulli(tensor([.3, .5, .9, .1]))
  for (auto [p, want] : std::vector<std::pair<float, bool>>{
           {0.3f, false}, {0.5f, true}, {0.9f, false}, {0.1f, false}})
    EXPECT_EQ(b.bernoulli(p), want);
  TorchCpuGenerator high(uint64_t{1} << 32 | 7);  // manual_seed keeps the low 32 bits
  for (int64_t want : {615, 892, 721}) EXPECT_EQ(high.randint(0, 1000), want);
  TorchCpuGenerator wide(7);  // a range of 2^33 takes 64-bit draws
  for (int64_t want : {5271381188, 5664942582, 8496402643})
    EXPECT_EQ(wide.randint(0, int64_t{1} << 33), want);
  EXPECT_NE(error_of([&] { g.randint(3, 3); }), "");
}

TEST(TaskRng, PythonRandomMatchesCPython) {
  // random.Random(seed).shuffle(list(range(12))) and getrandbits(32) in CPython 3.
  const std::vector<std::pair<uint64_t, std::vector<int>>> cases{
      {20260506, {1, 11, 6, 10, 5, 8, 4, 3, 7, 9, 0, 2}},
      {0, {1, 9, 8, 5, 10, 2, 3, 7, 4, 0, 11, 6}},
      {(uint64_t{1} << 40) + 5, {3, 5, 2, 9, 6, 7, 1, 10, 0, 4, 11, 8}}};
  for (const auto& [seed, want] : cases) {
    std::vector<int> x(12);
    std::iota(x.begin(), x.end(), 0);
    PythonRandom(seed).shuffle(x);
    EXPECT_EQ(x, want) << "seed " << seed;
  }
  PythonRandom r(20260506);
  for (uint32_t want : {692677029u, 107658581u, 2607946567u}) EXPECT_EQ(r.getrandbits(32), want);
}

// ---------------------------------------------------------------------------------------------
// Synthetic query-LM

TEST(TaskQueryLm, ReproducesTheReferenceGeneratorOnCpu) {
  // run_kernel_lm.generate_batch on a CPU generator seeded 7107 + 1 * 1000003, L 8, d_head 16,
  // frequency index 2 (omega = 0.1), then batches (T 12, B 3) and (T 20, B 2). Reference scores
  // are float32.
  QueryLmConfig c;
  c.seq_len_train = 8;
  c.d_model = 16;
  c.n_heads = 1;
  c.target_freq_index = 2;
  QueryLmGenerator g = query_lm_train_stream(c, 1);
  EXPECT_NEAR(g.teacher().omega(), 0.1, 1e-15);
  const QueryLmBatch a = g.next(12, 3);
  const std::vector<std::vector<int64_t>> bits_a{{1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0},
                                                 {1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0},
                                                 {0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1}};
  for (int b = 0; b < 3; ++b) {
    std::vector<int64_t> row(a.tokens.begin() + b * 12, a.tokens.begin() + b * 12 + 11);
    EXPECT_EQ(row, bits_a[b]);
    EXPECT_EQ(a.tokens[b * 12 + 11], kQueryLmQuery);
  }
  EXPECT_EQ(a.labels, (std::vector<int64_t>{0, 1, 0}));
  const std::vector<double> scores_a{-0.5174269080162048, 1.5510846376419067, -2.662280559539795};
  for (int b = 0; b < 3; ++b) EXPECT_NEAR(a.scores[b], scores_a[b], 2e-6);
  const QueryLmBatch b2 = g.next(20, 2);
  const std::vector<int64_t> row0(b2.tokens.begin(), b2.tokens.begin() + 19);
  EXPECT_EQ(row0, (std::vector<int64_t>{1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(b2.labels, (std::vector<int64_t>{1, 0}));
  EXPECT_NEAR(b2.scores[0], 2.1575770378112793, 2e-6);
  EXPECT_NEAR(b2.scores[1], -1.5691821575164795, 2e-6);
}

TEST(TaskQueryLm, TeacherKernelsByHand) {
  // float64 values from the spec formulas (jordan-rope.md 3.2, 3.4, 3.5), written out again here.
  const double L = 1024, w = std::pow(1e4, -6.0 / 32), w2 = std::pow(1e4, -10.0 / 32);
  EXPECT_NEAR(w, 0.1778279, 1e-7);  // the spec's omega for d_head 32
  struct Case {
    std::string name;
    double (*k)(double, double, double, double);
  };
  const std::vector<Case> cases{
      {"mixed_raw", [](double d, double L, double w, double) { return d / L * std::cos(w * d); }},
      {"mixed_bounded",
       [](double d, double L, double w, double) { return d / (1 + d / L) / L * std::cos(w * d); }},
      {"damped_mixed",
       [](double d, double L, double w, double) {
         return std::exp(-1e-4 * d) * (std::cos(w * d) + 0.75 * d / L * std::sin(w * d));
       }},
      {"rhythm_envelope",
       [](double d, double L, double w, double w2) {
         return (0.25 + 0.85 * d / L) * (0.65 * std::cos(w * d) + 0.35 * std::sin(w2 * d));
       }},
      {"high_jet_r2",
       [](double d, double L, double w, double) { return d * d / (L * L) * std::cos(w * d); }},
      {"scaled_high_jet_r3",
       [](double d, double L, double w, double) {
         const double x = d / L;
         return x * x * x * std::exp(-0.1 * x) * std::cos(w * d);
       }},
  };
  for (const Case& cs : cases) {
    QueryLmConfig c = query_lm_table5();
    c.benchmark = cs.name;
    const QueryLmTeacher t(c);
    double ss = 0;
    for (int d = 1; d < 1024; ++d) ss += std::pow(cs.k(d, L, w, w2), 2);
    EXPECT_NEAR(t.norm(), std::sqrt(ss), 1e-12 * std::sqrt(ss)) << cs.name;
    const std::vector<double> k = t.kernel(4096);
    ASSERT_EQ(k.size(), 4095u);
    for (int d : {1, 2, 37, 1023, 1024, 4095})
      EXPECT_NEAR(k[d - 1], cs.k(d, L, w, w2) / std::sqrt(ss), 1e-13) << cs.name << " d=" << d;
  }
  // Training-length norms quoted by the spec: 13.0330 (Table 5), 4.5641 and 3.8090 (Table 10).
  EXPECT_NEAR(QueryLmTeacher(query_lm_table5()).norm(), 13.0330, 5e-5);
  EXPECT_NEAR(QueryLmTeacher(query_lm_table10_second_jet()).norm(), 4.5641, 5e-5);
  EXPECT_NEAR(QueryLmTeacher(query_lm_table10_third_jet()).norm(), 3.8090, 5e-5);
  EXPECT_NEAR(QueryLmTeacher(query_lm_table10_second_jet()).omega(), 0.3162278, 1e-7);
}

TEST(TaskQueryLm, ScoreScaleGrowsWithLengthAsTheSpecSays) {
  // std(score) = ||K(1..T-1)|| / ||K(1..L-1)||: 1.0, 2.83, 8.01, 22.67 at T = 1024..8192.
  const QueryLmTeacher t(query_lm_table5());
  const std::vector<std::pair<int64_t, double>> want{
      {1024, 1.0}, {2048, 2.83}, {4096, 8.01}, {8192, 22.67}};
  for (auto [T, sd] : want) {
    double ss = 0;
    for (double k : t.kernel(T)) ss += k * k;
    EXPECT_NEAR(std::sqrt(ss), sd, 0.006) << "T=" << T;
  }
}

TEST(TaskQueryLm, BatchStatistics) {
  const QueryLmConfig c = query_lm_table5();
  QueryLmGenerator g = query_lm_train_stream(c, 0);
  const QueryLmBatch b = g.next(1024, 3000);
  const std::vector<double> k = g.teacher().kernel(1024);
  double ones = 0, pos = 0, s1 = 0, s2 = 0;
  for (int64_t r = 0; r < b.batch; ++r) {
    const int64_t* row = b.tokens.data() + r * 1024;
    double score = 0;
    for (int64_t j = 0; j < 1023; ++j) {
      ASSERT_TRUE(row[j] == kQueryLmBit0 || row[j] == kQueryLmBit1);
      ones += static_cast<double>(row[j]);
      score += (2.0 * static_cast<double>(row[j]) - 1.0) * k[1022 - j];  // lag 1023 - j
    }
    ASSERT_EQ(row[1023], kQueryLmQuery);
    EXPECT_NEAR(b.scores[r], score, 1e-9);
    EXPECT_EQ(b.labels[r], score > 0 ? 1 : 0);
    pos += static_cast<double>(b.labels[r]);
    s1 += score;
    s2 += score * score;
  }
  EXPECT_NEAR(ones / (3000.0 * 1023.0), 0.5, 0.003);
  EXPECT_NEAR(pos / 3000.0, 0.5, 0.04);  // a symmetric score: balanced labels (4 sigma)
  const double sd = std::sqrt(s2 / 3000.0 - (s1 / 3000.0) * (s1 / 3000.0));
  EXPECT_NEAR(sd, 1.0, 0.06);  // normalised by the training-length kernel norm
}

TEST(TaskQueryLm, SeedsPerSplitAndDeterminism) {
  const QueryLmConfig c = query_lm_table5();
  EXPECT_EQ(query_lm_train_seed(c, 2), 7107u + 2u * 1000003u);
  EXPECT_EQ(query_lm_eval_seed(c, 2, 4096), 9109u + 2u * 1009u + 4096u);
  auto first = [&](int64_t seed) { return query_lm_train_stream(c, seed).next(64, 4).tokens; };
  EXPECT_EQ(first(0), first(0));
  EXPECT_NE(first(0), first(1));
  const auto e1 = query_lm_eval_set(c, 0, 64), e2 = query_lm_eval_set(c, 0, 64);
  ASSERT_EQ(e1.size(), 32u);
  EXPECT_EQ(e1[0].batch, 1);
  for (size_t i = 0; i < e1.size(); ++i) EXPECT_EQ(e1[i].tokens, e2[i].tokens);
  EXPECT_NE(e1[0].tokens, query_lm_eval_set(c, 1, 64)[0].tokens);
  EXPECT_NE(e1[0].tokens, first(0));
  // Lengths draw from different generators: the 128 set is not the 64 set extended.
  const auto e3 = query_lm_eval_set(c, 0, 128);
  EXPECT_FALSE(std::equal(e1[0].tokens.begin(), e1[0].tokens.end() - 1, e3[0].tokens.begin()));
}

TEST(TaskQueryLm, StochasticLabelsFollowTheScore) {
  QueryLmConfig c = query_lm_table5();
  c.label_mode = QueryLmLabels::Stochastic;
  QueryLmGenerator g(c, 11);
  const QueryLmBatch b = g.next(256, 4000);
  double agree = 0, expected = 0;
  for (int64_t r = 0; r < b.batch; ++r) {
    agree += (b.labels[r] == (b.scores[r] > 0 ? 1 : 0)) ? 1.0 : 0.0;
    const double p = 1.0 / (1.0 + std::exp(-3.0 * b.scores[r]));
    expected += std::max(p, 1.0 - p);
  }
  EXPECT_NEAR(agree / 4000.0, expected / 4000.0, 0.03);
  EXPECT_EQ(QueryLmGenerator(c, 11).next(256, 4000).labels, b.labels);
}

TEST(TaskQueryLm, BadConfigsAreNamed) {
  QueryLmConfig c;
  c.benchmark = "mixed_rwa";
  EXPECT_NE(error_of([&] { QueryLmTeacher t(c); }).find("valid: mixed_raw"), std::string::npos);
  c.benchmark = "high_jet_rx";
  EXPECT_NE(error_of([&] { QueryLmTeacher t(c); }).find("unknown benchmark"), std::string::npos);
  c = QueryLmConfig{};
  c.seq_len_train = 1;
  EXPECT_NE(error_of([&] { QueryLmTeacher t(c); }).find("seq_len_train"), std::string::npos);
  QueryLmGenerator g(QueryLmConfig{}, 1);
  EXPECT_NE(error_of([&] { g.next(1, 2); }).find("length"), std::string::npos);
  EXPECT_NE(error_of([&] { g.next(16, 0); }).find("batch"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// LM windows

TEST(TaskLmWindows, StartsMatchTheReferenceAndStayInBounds) {
  LmProtocol p;
  p.train_sample_seed = 1701;
  const int64_t T = 16, n = T + 1 + 1000;  // max_start (exclusive) = 1000
  WindowSampler s(n, T, lm_train_generator_seed(p, 0));
  EXPECT_EQ(s.next_starts(3), (std::vector<int64_t>{814, 492, 390}));
  EXPECT_EQ(s.next_starts(3), (std::vector<int64_t>{558, 250, 251}));

  std::vector<int64_t> tokens(100);
  std::iota(tokens.begin(), tokens.end(), 5);
  WindowSampler w(100, 10, 42);
  for (int step = 0; step < 200; ++step) {
    const std::vector<int64_t> starts = w.next_starts(4);
    const std::vector<int64_t> win = gather_windows(tokens, starts, 10);
    ASSERT_EQ(win.size(), 4u * 11u);
    for (size_t b = 0; b < 4; ++b) {
      ASSERT_GE(starts[b], 0);
      ASSERT_LE(starts[b], 100 - 10 - 2);
      for (size_t t = 0; t < 11; ++t) ASSERT_EQ(win[b * 11 + t], tokens[starts[b] + t]);
    }
  }
  auto draw = [](uint64_t seed) { return WindowSampler(100, 10, seed).next_starts(8); };
  EXPECT_EQ(draw(lm_train_generator_seed(p, 1)), draw(1701 + 1000003));
  EXPECT_NE(draw(lm_train_generator_seed(p, 0)), draw(lm_train_generator_seed(p, 1)));
  EXPECT_NE(error_of([] { WindowSampler(11, 10, 1); }).find("at least 12 tokens"),
            std::string::npos);
  EXPECT_NO_THROW(WindowSampler(12, 10, 1));
  EXPECT_NE(error_of([&] { gather_windows(tokens, std::vector<int64_t>{90}, 10); }), "");
}

TEST(TaskLmWindows, EvalStartsIgnoreTheTrainingSeed) {
  LmProtocol p = lm_protocol_music();
  const auto a = lm_eval_starts(5000, p), b = lm_eval_starts(5000, p);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].length, p.eval_lengths[i]);
    ASSERT_EQ(a[i].batches.size(), 32u);
    EXPECT_EQ(a[i].batches, b[i].batches);
    for (const auto& batch : a[i].batches) {
      ASSERT_EQ(batch.size(), 4u);
      for (int64_t s : batch) ASSERT_TRUE(s >= 0 && s <= 5000 - a[i].length - 2);
    }
  }
  p.eval_sample_seed += 1;
  EXPECT_NE(lm_eval_starts(5000, p)[0].batches, a[0].batches);
  EXPECT_NE(error_of([&] { lm_eval_starts(2049, p); }).find("length 2048"), std::string::npos);
}

TEST(TaskLmWindows, SplitPoint) {
  EXPECT_EQ(split_point(1115394, 0.1), 1003854);  // Tiny Shakespeare: 1,003,854 / 111,540
  EXPECT_EQ(split_point(10, 0.5), 5);
  EXPECT_NE(error_of([] { split_point(10, 0.0); }), "");
  EXPECT_NE(error_of([] { split_point(10, 1.0); }), "");
  EXPECT_NE(error_of([] { split_point(10, std::nan("")); }), "");
}

// ---------------------------------------------------------------------------------------------
// Byte and character corpora

TEST(TaskTextLm, ByteCorpus) {
  TempDir dir;
  std::string text = "ab\n";
  text += '\0';
  text += '\xff';
  text += "0123456789";  // 15 bytes
  const fs::path f = dir.write("t.txt", text);
  const TokenCorpus c = byte_corpus_split(f, 0.2);
  EXPECT_EQ(c.vocab_size, kByteVocab);
  ASSERT_EQ(c.train.size(), 12u);
  ASSERT_EQ(c.validation.size(), 3u);
  EXPECT_EQ(c.train[0], 'a' + 1);
  EXPECT_EQ(c.train[3], 1);    // byte 0
  EXPECT_EQ(c.train[4], 256);  // byte 255
  EXPECT_EQ(c.validation.back(), '9' + 1);
  const TokenCorpus two = byte_corpus(f, dir.write("v.txt", "xyz"));
  EXPECT_EQ(two.train.size(), 15u);
  EXPECT_EQ(two.validation, (std::vector<int64_t>{'x' + 1, 'y' + 1, 'z' + 1}));
  EXPECT_NE(error_of([&] { byte_corpus(dir.path / "missing.txt", f); }).find("missing.txt"),
            std::string::npos);
}

TEST(TaskTextLm, CharCorpusVocabularyAndUnknowns) {
  TempDir dir;
  const fs::path train = dir.write("train.txt",
                                   "\xEF\xBB\xBF"
                                   "b\xC3\xA9"
                                   "a\xE2\x9C\x93"
                                   "b\xF0\x9F\x98\x80");
  const fs::path val = dir.write("val.txt", "ab\xC3\xA9z\xE2\x9C\x93");
  EXPECT_NE(error_of([&] { char_corpus(train, val); }).find("U+007A at byte offset 4"),
            std::string::npos);
  const CharCorpus c = char_corpus(train, val, UnknownChars::ReservedId);
  // sorted code points: a, b, U+00E9, U+2713, U+FEFF (the BOM), U+1F600; then the reserved id 6
  EXPECT_EQ(c.vocab.chars,
            (std::u32string{U'a', U'b', U'\u00E9', U'\u2713', U'\uFEFF', U'\U0001F600'}));
  EXPECT_EQ(c.tokens.vocab_size, 7);
  EXPECT_EQ(c.tokens.train, (std::vector<int64_t>{4, 1, 2, 0, 3, 1, 5}));
  EXPECT_EQ(c.tokens.validation, (std::vector<int64_t>{0, 1, 2, 6, 3}));
  EXPECT_EQ(c.unknown_in_validation, 1);
  EXPECT_EQ(c.vocab.decode(c.tokens.validation), "ab\xC3\xA9\xEF\xBF\xBD\xE2\x9C\x93");
  EXPECT_EQ(c.vocab.decode(c.tokens.train),
            "\xEF\xBB\xBF"
            "b\xC3\xA9"
            "a\xE2\x9C\x93"
            "b\xF0\x9F\x98\x80");

  // One file split by code points; the vocabulary comes from the first part only.
  const fs::path one = dir.write("one.txt",
                                 "abcab\xC3\xA9\xC3\xA9"
                                 "ab\xE2\x9C\x93");  // 10 code points
  EXPECT_NE(error_of([&] { char_corpus_split(one, 0.5); }).find("U+00E9 at byte offset 5"),
            std::string::npos);
  const CharCorpus s = char_corpus_split(one, 0.5, UnknownChars::ReservedId);  // 5 + 5
  EXPECT_EQ(s.vocab.chars, (std::u32string{U'a', U'b', U'c'}));
  EXPECT_EQ(s.tokens.train, (std::vector<int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(s.tokens.validation, (std::vector<int64_t>{3, 3, 0, 1, 3}));
  EXPECT_EQ(s.unknown_in_validation, 3);
}

TEST(TaskTextLm, StrictUtf8) {
  const std::vector<std::pair<std::string, std::string>> bad{
      {"a\xC0\x80", "offset 1: overlong"},
      {"ab\xED\xA0\x80", "offset 2: surrogate"},
      {"\xF4\x90\x80\x80", "above U+10FFFF"},
      {"xy\xE2\x82", "offset 2: sequence truncated"},
      {"\x80", "continuation byte without a lead byte"},
      {"\xF8\x88\x80\x80\x80", "invalid lead byte"},
      {"\xC3(", "expected a continuation byte"}};
  for (const auto& [bytes, want] : bad) {
    const std::string msg = error_of([&] { decode_utf8(bytes, "f.txt"); });
    EXPECT_NE(msg.find("f.txt: invalid UTF-8 at byte"), std::string::npos) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  EXPECT_EQ(decode_utf8("\xF4\x8F\xBF\xBF", "ok"), std::u32string(1, U'\U0010FFFF'));
  TempDir dir;
  EXPECT_NE(error_of([&] { char_corpus_split(dir.write("e.txt", ""), 0.1); }).find("no characters"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// MIDI

TEST(TaskMidi, OneNoteByHand) {
  // 120 bpm, 480 ticks per beat: the note lasts 0.5 s = 25 quanta of 0.02 s.
  // [separator, note-on 60 (33 + 39), shift 25, note-off 60 (121 + 39)]
  EXPECT_EQ(tokens_of(one_note(60)), (std::vector<int32_t>{0, 72, 25, 160}));
}

TEST(TaskMidi, PrettyMidiSemantics) {
  // Expected tokens from the reference (pretty_midi 0.2.11 + the prepare script's encoder) on these
  // bytes. Track 0: 120 bpm, then 240 bpm from tick 192 (1.0 s); 96 ticks per beat.
  const Bytes conductor = track(
      {{0, raw({0xFF, 0x51, 3, 0x07, 0xA1, 0x20})}, {192, raw({0xFF, 0x51, 3, 0x03, 0xD0, 0x90})}});
  const Bytes piano = track({{0, raw({0x90, 60, 100})},
                             {0, raw({61, 100})},          // running status
                             {48, raw({0x80, 60, 64})},    // 0.25 s
                             {48, raw({0x90, 61, 0})},     // note-on of velocity 0 = off
                             {96, raw({0x90, 20, 100})},   // below the piano range
                             {96, raw({0x90, 109, 100})},  // above it
                             {96, raw({0x90, 62, 100})},   // on and off at one tick: dropped
                             {96, raw({0x80, 62, 0})},
                             {144, raw({0x90, 64, 100})},  // two open notes of one pitch ...
                             {192, raw({0x90, 64, 90})},
                             {288, raw({0x80, 64, 0})},  // ... closed by one note-off (1.25 s)
                             {288, raw({0x80, 20, 0})},
                             {288, raw({0x80, 109, 0})},
                             {300, raw({0x90, 65, 100})}});  // never closed: dropped
  const Bytes other =
      track({{0, raw({0x99, 36, 100})},  // channel 10: drums, left out
             {48, raw({0x89, 36, 0})},
             {96, raw({0x91, 67, 80})},
             {100, raw({0xFF, 0x51, 3, 0x0F, 0x42, 0x40})},  // tempo outside track 0: ignored
             {240, raw({0x81, 67, 0})}});
  const Bytes file = smf(1, 96, {conductor, piano, other});
  EXPECT_EQ(tokens_of(file), (std::vector<int32_t>{0, 72, 73, 12, 160, 161, 13, 79, 13, 76, 12, 76,
                                                   6, 167, 6, 164, 164}));

  const SmfFile f =
      parse_smf({reinterpret_cast<const uint8_t*>(file.data()), file.size()}, "x.mid");
  EXPECT_EQ(f.format, 1);
  EXPECT_EQ(f.ticks_per_beat, 96);
  ASSERT_EQ(f.tracks.size(), 3u);
  EXPECT_EQ(f.trailing_bytes, 0);
  const std::vector<MidiNote> notes = smf_notes(f, "x.mid");
  EXPECT_EQ(notes.size(), 8u);  // 60, 61, 20, 109, 64 twice, drum 36, 67
}

TEST(TaskMidi, RoundHalfToEvenAndLongShifts) {
  // 1 tick per beat at 10000 us per beat: 0.01 s per tick. Event times 0.01, 0.03, 0.05, 1.45 s
  // are 0.5, 1.5, 2.5, 72.5 quanta: Python's round gives 0, 2, 2, 72. The 70-quantum gap is
  // written 32, 32, 6.
  const Bytes file = smf(0, 1,
                         {track({{0, raw({0xFF, 0x51, 3, 0x00, 0x27, 0x10})},
                                 {1, raw({0x90, 60, 1})},
                                 {3, raw({0x80, 60, 0})},
                                 {5, raw({0x90, 61, 1})},
                                 {145, raw({0x80, 61, 0})}})});
  EXPECT_EQ(tokens_of(file), (std::vector<int32_t>{0, 72, 2, 160, 73, 32, 32, 6, 161}));
}

TEST(TaskMidi, MalformedFilesAreNamedErrors) {
  const Bytes good = one_note(60);
  const Bytes trk = track({{0, raw({0x90, 60, 100})}, {480, raw({0x80, 60, 0})}});
  struct Case {
    std::string what;
    Bytes bytes;
    std::string want;
  };
  const std::vector<Case> cases{
      {"truncated track", good.substr(0, good.size() - 5),
       "track 0: chunk length 13 runs past the end of the file (30 bytes)"},
      {"cut in the header", good.substr(0, 10), "header chunk of 6 bytes runs past the end"},
      {"wrong header", "RIFF" + good.substr(4),
       "not a Standard MIDI File (expected 'MThd', found 'RIFF')"},
      {"empty file", "", "not a Standard MIDI File"},
      {"zero tracks", "MThd" + be32(6) + be16(1) + be16(0) + be16(96), "declares no tracks"},
      {"missing track", "MThd" + be32(6) + be16(1) + be16(2) + be16(96) + trk,
       "track 1 of 2 missing"},
      {"short header", "MThd" + be32(4) + be16(0) + be16(1) + trk, "header chunk of 4 bytes"},
      {"SMPTE division", smf(0, -6000, {trk}), "SMPTE time division"},
      {"zero division", smf(0, 0, {trk}), "time division of 0"},
      {"not MTrk", smf(0, 96, {"MTrx" + trk.substr(4)}),
       "track 0: expected 'MTrk', found 'MTrx' at byte offset 14"},
      {"VLQ of 5 bytes",
       smf(0, 96, {"MTrk" + be32(9) + raw({0x81, 0x81, 0x81, 0x81, 0x00, 0x90, 60, 100, 0})}),
       "track 0: delta time is a variable-length quantity longer than 4 bytes at byte offset 22"},
      {"VLQ cut off", smf(0, 96, {"MTrk" + be32(2) + raw({0x81, 0x81})}),
       "delta time cut off by the end of the file"},
      {"VLQ crossing the chunk", smf(0, 96, {"MTrk" + be32(1) + raw({0x81}), trk}),
       "delta time crosses the end of the track chunk"},
      {"event crossing the chunk",
       smf(0, 96, {"MTrk" + be32(3) + raw({0x00, 0x90, 60}) + raw({100}), trk}),
       "message data crosses the end of the track chunk"},
      {"running status first", smf(0, 96, {"MTrk" + be32(3) + raw({0x00, 60, 100})}),
       "running status without"},
      {"data byte > 127", smf(0, 96, {"MTrk" + be32(4) + raw({0x00, 0x90, 60, 0xC8})}),
       "data byte 0xc8 above 127"},
      {"undefined status", smf(0, 96, {"MTrk" + be32(2) + raw({0x00, 0xF4})}),
       "undefined status byte 0xf4"},
      {"running status after sysex",
       smf(0, 96,
           {"MTrk" + be32(8) + raw({0x00, 0x90, 60, 100, 0x00, 0xF0, 0x00, 0x00}) + raw({})}),
       ""},
      {"sysex data > 127",
       smf(0, 96, {"MTrk" + be32(6) + raw({0x00, 0xF0, 0x03, 0x01, 0x80, 0xF7})}),
       "sysex data byte 0x80"},
      {"short tempo", smf(0, 96, {"MTrk" + be32(6) + raw({0x00, 0xFF, 0x51, 0x02, 0x07, 0xA1})}),
       "tempo of 2 bytes"},
      {"bad key signature",
       smf(0, 96, {"MTrk" + be32(6) + raw({0x00, 0xFF, 0x59, 0x02, 0x08, 0x00})}),
       "key signature 8 sharps"},
      {"meta past the chunk", smf(0, 96, {"MTrk" + be32(5) + raw({0x00, 0xFF, 0x01, 0x05, 0x41})}),
       "meta event cut off by the end of the file"},
      {"empty track", smf(0, 96, {"MTrk" + be32(0)}), "track 0 has no events"},
      {"tempo 0",
       smf(0, 96, {track({{0, raw({0xFF, 0x51, 3, 0, 0, 0})}, {1, raw({0x90, 60, 1})}})}),
       "tempo of 0"},
      {"largest tick",
       smf(0, 96, {track({{0, raw({0x90, 60, 1})}, {10000000, raw({0x80, 60, 0})}})}),
       "largest tick 10000001 above 10000000"},
  };
  for (const Case& c : cases) {
    std::string msg;
    try {
      tokens_of(c.bytes, "bad.mid");
    } catch (const MidiError& e) {
      msg = e.what();
    }
    if (c.want.empty()) {  // a data byte after sysex: no running status, so an error too
      EXPECT_NE(msg, "") << c.what;
      continue;
    }
    EXPECT_EQ(msg.rfind("bad.mid: ", 0), 0u) << c.what << ": " << msg;
    EXPECT_NE(msg.find(c.want), std::string::npos) << c.what << ": " << msg;
  }
}

TEST(TaskMidi, NoPrefixOrCorruptionCrashes) {
  // Every prefix of a valid file and random corruptions either tokenise or raise MidiError (the
  // sanitizer build checks that no byte outside the buffer is read).
  const Bytes file =
      smf(1, 96,
          {track({{0, raw({0xFF, 0x51, 3, 0x07, 0xA1, 0x20})}, {5, raw({0xF0, 2, 1, 0xF7})}}),
           track({{0, raw({0x90, 60, 100})},
                  {0, raw({62, 100})},
                  {300, raw({0x80, 60, 0})},
                  {300, raw({0x80, 62, 0})},
                  {400, raw({0xFF, 0x03, 3, 'a', 'b', 'c'})}})});
  ASSERT_EQ(tokens_of(file).size(), 8u);  // 1.5625 s = 78 quanta: shifts 32, 32, 14
  for (size_t n = 0; n < file.size(); ++n)
    EXPECT_THROW(tokens_of(file.substr(0, n)), MidiError) << n;
  std::mt19937_64 rng(3);
  int ok = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes b = file;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng() % 256);
    try {
      tokens_of(b);
      ++ok;
    } catch (const MidiError&) {
    }
  }
  EXPECT_GT(ok, 0);
}

TEST(TaskMidi, CorpusSplitSkipsAndWarns) {
  TempDir dir;
  const fs::path root = dir.path / "midi";
  // Sorted names; CPython's random.Random(20260506).shuffle(range(6)) gives [2, 5, 4, 3, 0, 1] and
  // round(6 * 0.2) = 1 file validates: c_trailing.mid. Each file plays its own pitch.
  dir.write("midi/a.mid", one_note(60));
  dir.write("midi/b.mid", one_note(62));
  dir.write("midi/c_trailing.mid", one_note(67) + "junk");
  dir.write("midi/d_bad.mid", one_note(69).substr(0, 20));
  dir.write("midi/sub/e.MIDI", one_note(64));
  dir.write("midi/sub/f.mid", one_note(65));
  dir.write("midi/notes.txt", "not midi");
  std::vector<std::string> warned;
  const MidiCorpus c =
      load_midi_corpus(root, {}, [&](const std::string& m) { warned.push_back(m); });
  EXPECT_EQ(c.validation_files, (std::vector<std::string>{"c_trailing.mid"}));
  EXPECT_EQ(c.train_files, (std::vector<std::string>{"sub/f.mid", "sub/e.MIDI", "a.mid", "b.mid"}));
  auto note = [](int p) { return std::vector<int32_t>{0, 33 + p - 21, 25, 121 + p - 21}; };
  std::vector<int32_t> train;
  for (int p : {65, 64, 60, 62}) {
    const auto n = note(p);
    train.insert(train.end(), n.begin(), n.end());
  }
  EXPECT_EQ(c.train_events, train);
  EXPECT_EQ(c.validation_events, note(67));
  ASSERT_EQ(c.tokens.train.size(), train.size());
  for (size_t i = 0; i < train.size(); ++i) EXPECT_EQ(c.tokens.train[i], train[i] + 1);
  EXPECT_EQ(c.tokens.vocab_size, 257);
  ASSERT_EQ(c.skipped.size(), 1u);
  EXPECT_EQ(c.skipped[0].rfind("d_bad.mid: ", 0), 0u) << c.skipped[0];
  ASSERT_EQ(warned.size(), 2u);
  EXPECT_EQ(warned, c.warnings);
  EXPECT_NE(warned[0].find("c_trailing.mid: ignoring 4 bytes after the 1 declared track"),
            std::string::npos)
      << warned[0];
  EXPECT_NE(warned[1].find("skipping d_bad.mid: "), std::string::npos) << warned[1];

  // The reference's train.bin / eval.bin, read back by the byte loader as the same LM tokens.
  save_midi_corpus(c, dir.path / "out");
  const TokenCorpus back =
      byte_corpus(dir.path / "out" / "train.bin", dir.path / "out" / "eval.bin");
  EXPECT_EQ(back.train, c.tokens.train);
  EXPECT_EQ(back.validation, c.tokens.validation);

  MidiCorpusOptions strict;
  strict.keep_files_with_trailing_bytes = false;
  const MidiCorpus s = load_midi_corpus(root, strict, nullptr);
  EXPECT_TRUE(s.validation_files.empty());
  EXPECT_EQ(s.skipped.size(), 2u);
  EXPECT_NE(error_of([&] { load_midi_corpus(dir.path / "nope"); }).find("not a readable directory"),
            std::string::npos);
  fs::create_directories(dir.path / "empty");
  EXPECT_NE(error_of([&] { load_midi_corpus(dir.path / "empty"); }).find("no .mid"),
            std::string::npos);
}

// ---- the PJ-RoPE synthetic bridge (pj-rope.md 3.3)
// -----------------------------------------------

namespace {

std::string pj_error_of(const PjQueryLmConfig& c) {
  try {
    PjQueryLmTeacher t(c);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(TaskPjQueryLm, TargetKernelsByHand) {
  // the spec's formulas written out again, x = d / L, omega = 2 pi 17 / L
  const double L = 96, w = 2 * std::acos(-1.0) * 17 / L;
  const auto beta = [&](double d) { return d / std::sqrt(d * d + L * L); };
  const auto phi = [&](double d) { return L * std::asinh(d / L); };
  const auto lc_core = [&](double d) {
    return std::cos(w * phi(d)) * (1 + 0.4 * beta(d) + 0.2 * beta(d) * beta(d));
  };
  const std::vector<std::pair<std::string, std::function<double(double)>>> cases{
      {"phase", [&](double d) { return std::cos(w * d); }},
      {"first_jet", [&](double d) { return d / L * std::cos(w * d); }},
      {"second_jet",
       [&](double d) { return std::pow(d / L, 2) * std::exp(-0.1 * d / L) * std::cos(w * d); }},
      {"third_jet",
       [&](double d) { return std::pow(d / L, 3) * std::exp(-0.1 * d / L) * std::cos(w * d); }},
      {"affine", [&](double d) { return -0.4 * d / L; }},
      {"recency_weak_jet",
       [&](double d) { return -0.4 * d / L + 0.15 * std::pow(d / L, 2) * std::cos(w * d); }},
      {"lc_core", lc_core},
      {"lc_affine", [&](double d) { return lc_core(d) - 0.25 * std::asinh(d / L); }},
  };
  ASSERT_EQ(cases.size(), pj_query_lm_targets().size());
  for (const auto& [name, k] : cases) {
    PjQueryLmConfig c;
    c.target = name;
    const PjQueryLmTeacher t(c);
    EXPECT_NEAR(t.omega(), w, 1e-15);
    for (double d : {1.0, 5.0, 47.0, 95.0, 383.0}) EXPECT_NEAR(t.kernel(d), k(d), 1e-13) << name;
    // signed: the kernel over lags [T-1, ..., 1], unit norm at every length
    for (int64_t T : {48, 192}) {
      const auto coeff = t.coefficients(T);
      ASSERT_EQ(coeff.size(), static_cast<size_t>(T - 1));
      double ss = 0;
      for (double v : coeff) ss += v * v;
      EXPECT_NEAR(ss, 1.0, 1e-12) << name;
      EXPECT_NEAR(coeff[0] / coeff[static_cast<size_t>(T - 2)], k(T - 1) / k(1), 1e-9) << name;
    }
  }
  // attention: softmax(lambda k); the affine teacher weighs recent bits most
  PjQueryLmConfig c;
  c.target = "affine";
  c.teacher = "attention";
  const auto a = PjQueryLmTeacher(c).coefficients(96);
  EXPECT_NEAR(std::accumulate(a.begin(), a.end(), 0.0), 1.0, 1e-12);
  EXPECT_NEAR(a[94] / a[0], std::exp(4 * 0.4 * (95.0 - 1.0) / 96), 1e-9);  // lag 1 vs lag 95
}

TEST(TaskPjQueryLm, LabelsComeFromTheTeacher) {
  for (const std::string teacher : {"signed", "attention"}) {
    PjQueryLmConfig c;
    c.target = "second_jet";
    c.teacher = teacher;
    PjQueryLmGenerator g(c, 5);
    const PjQueryLmTeacher t(c);
    const auto coeff = t.coefficients(40);
    const QueryLmBatch b = g.next(40, 64);
    ASSERT_EQ(b.tokens.size(), 64u * 40u);
    int ones = 0;
    for (int64_t r = 0; r < 64; ++r) {
      double score = 0;
      for (int64_t j = 0; j < 39; ++j) {
        const int64_t tok = b.tokens[static_cast<size_t>(r * 40 + j)];
        ASSERT_TRUE(tok == 0 || tok == 1);
        score += (2.0 * static_cast<double>(tok) - 1.0) * coeff[static_cast<size_t>(j)];
      }
      EXPECT_EQ(b.tokens[static_cast<size_t>(r * 40 + 39)], kQueryLmQuery);
      EXPECT_NEAR(b.scores[static_cast<size_t>(r)], score, 1e-12);
      EXPECT_EQ(b.labels[static_cast<size_t>(r)], score > 0 ? 1 : 0);
      ones += static_cast<int>(b.labels[static_cast<size_t>(r)]);
    }
    // attention weights are positive, so with the fixed threshold 0 the label is a majority vote
    EXPECT_GT(ones, 0) << teacher;
    EXPECT_LT(ones, 64) << teacher;
  }
}

TEST(TaskPjQueryLm, MedianThresholdBalancesEveryBatch) {
  PjQueryLmConfig c;
  c.target = "affine";
  c.teacher = "attention";  // every score positive: threshold 0 would label almost all 1
  c.median_threshold = true;
  PjQueryLmGenerator g(c, 11);
  for (int64_t batch : {96, 7, 2}) {
    const QueryLmBatch b = g.next(96, batch);
    std::vector<double> sorted = b.scores;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[static_cast<size_t>((batch - 1) / 2)];  // torch.median: lower
    int64_t ones = 0;
    for (int64_t r = 0; r < batch; ++r) {
      EXPECT_EQ(b.labels[static_cast<size_t>(r)], b.scores[static_cast<size_t>(r)] > median);
      ones += b.labels[static_cast<size_t>(r)];
    }
    EXPECT_EQ(ones, batch / 2) << batch;
  }
  // the evaluation sets too: 8 batches of 96, each exactly half ones
  c.eval_batches = 8;
  c.eval_batch_size = 96;
  const auto set = pj_query_lm_eval_set(c, 1, 192);
  ASSERT_EQ(set.size(), 8u);
  for (const auto& b : set) {
    EXPECT_EQ(b.length, 192);
    EXPECT_EQ(std::accumulate(b.labels.begin(), b.labels.end(), int64_t{0}), 48);
  }
  // fixed sets: the same seed and length give the same batches, another seed others
  EXPECT_EQ(pj_query_lm_eval_set(c, 1, 192)[3].tokens, set[3].tokens);
  EXPECT_NE(pj_query_lm_eval_set(c, 2, 192)[3].tokens, set[3].tokens);
}

TEST(TaskPjQueryLm, MultiLengthTrainingCyclesOrDraws) {
  PjQueryLmConfig c;
  c.train_lengths = {48, 96};
  PjQueryLmTrainStream cycle(c, 0);
  for (int64_t s = 0; s < 6; ++s) EXPECT_EQ(cycle.next(3).length, s % 2 ? 96 : 48);
  EXPECT_EQ(cycle.steps(), 6);
  c.length_sampling = "random";
  PjQueryLmTrainStream a(c, 0), b(c, 0);
  std::vector<int64_t> seen;
  for (int s = 0; s < 40; ++s) {
    const auto x = a.next(2);
    EXPECT_EQ(x.tokens, b.next(2).tokens);  // a function of the seed
    seen.push_back(x.length);
  }
  EXPECT_NE(std::count(seen.begin(), seen.end(), 48), 0);
  EXPECT_NE(std::count(seen.begin(), seen.end(), 96), 0);
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 48) + std::count(seen.begin(), seen.end(), 96),
            40);
  c.train_lengths = {};
  c.train_length = 32;
  EXPECT_EQ(PjQueryLmTrainStream(c, 0).next(1).length, 32);  // no list: the training length
}

TEST(TaskPjQueryLm, BadConfigsNameTheProblem) {
  PjQueryLmConfig c;
  c.target = "fourth_jet";
  EXPECT_NE(pj_error_of(c).find("unknown target 'fourth_jet' (valid: phase, first_jet"),
            std::string::npos);
  c = {};
  c.teacher = "hinge";
  EXPECT_NE(pj_error_of(c).find("unknown teacher 'hinge' (valid: signed, attention)"),
            std::string::npos);
  c = {};
  c.length_sampling = "shuffle";
  EXPECT_NE(pj_error_of(c).find("length sampling"), std::string::npos);
  c = {};
  c.train_lengths = {48, 1};
  EXPECT_NE(pj_error_of(c).find("training sequence length 1"), std::string::npos);
  c = {};
  c.lambda = 0;
  EXPECT_NE(pj_error_of(c).find("lambda"), std::string::npos);
  EXPECT_THROW(PjQueryLmTeacher(PjQueryLmConfig{}).coefficients(1), InputError);
}

// ---- PJ-RoPE's MIDI-token text (tasks/midi_text.hpp) ----

namespace {

// Tempo 0.25 s per beat in track 0; track 1 on channel 2: gaps of 96 ticks (2.5 grid steps, which
// round half to even to 2), 48 ticks (1.25) and 200 beats (2500, clamped to 999).
Bytes midi_text_file() {
  return smf(1, 480,
             {track({{0, raw({0xFF, 0x51, 0x03, 0x03, 0xD0, 0x90})}}),
              track({{0, raw({0xC2, 5})},
                     {0, raw({0x92, 60, 100})},
                     {96, raw({0x92, 60, 0})},
                     {192, raw({0x92, 62, 90})},
                     {240, raw({0xB2, 64, 127})},
                     {288, raw({0x82, 62, 0})},
                     {288 + 480 * 200, raw({0x92, 64, 80})}})});
}

std::vector<std::string> midi_text_of(const Bytes& b, const MidiTextOptions& o) {
  return midi_text_tokens(
      parse_smf({reinterpret_cast<const uint8_t*>(b.data()), b.size()}, "t.mid"), "t.mid", o);
}

}  // namespace

// The expected tokens are what mido 1.2.10 (`for msg in MidiFile`) and the spec's rules give for
// the same bytes.
TEST(MidiText, TokensFollowMidoTimingAndSpellings) {
  const Bytes f = midi_text_file();
  EXPECT_EQ(
      midi_text_of(f, {.include_programs = true}),
      (std::vector<std::string>{"d000.pg005.c2", "d000.on060.v100.c2", "d002.off060.c2",
                                "d002.on062.v090.c2", "d002.off062.c2", "d999.on064.v080.c2"}));
  // A skipped control's time stays pending; shown, it takes its own 1.
  EXPECT_EQ(
      midi_text_of(f, {.include_controls = true}),
      (std::vector<std::string>{"d000.on060.v100.c2", "d002.off060.c2", "d002.on062.v090.c2",
                                "d001.cc064.v127.c2", "d001.off062.c2", "d999.on064.v080.c2"}));
  EXPECT_EQ(midi_text_of(f, {.max_events_per_piece = 2, .include_programs = true}),
            (std::vector<std::string>{"d000.pg005.c2", "d000.on060.v100.c2"}));
  // The tempo of track 0 governs track 1 (mido merges before converting): at 120 bpm the first
  // gap would be 5 grid steps.
  EXPECT_EQ(midi_text_of(f, {.grid_ms = 10})[1], "d005.off060.c2");
  const Bytes async = smf(2, 480, {track({{0, raw({0x90, 60, 100})}})});
  EXPECT_THROW(midi_text_of(async, {}), MidiError);
}

TEST(MidiText, CleanTextAsTheReference) {
  EXPECT_EQ(midi_text_clean("Dvo\xc5\x99\xc3\xa1k  Quintet\tin A&B"), "Dvo__k_Quintet_in_A_B");
  EXPECT_EQ(midi_text_clean(""), "NA");
  // the characters first, then the spaces: a tab is outside the set, not whitespace to collapse
  EXPECT_EQ(midi_text_clean("a \t b"), "a___b");
  EXPECT_EQ(midi_text_clean("  "), "_");
  EXPECT_EQ(midi_text_clean(std::string(100, 'x')), std::string(80, 'x'));
  EXPECT_EQ(midi_text_clean("1. Allegro (K.331), No:2/3+-"), "1._Allegro_(K.331),_No:2/3+-");
  EXPECT_THROW(midi_text_clean("\xff"), InputError);
}

TEST(MidiText, MusicnetSelectionShufflesCandidatesAndSkipsUnreadable) {
  TempDir dir;
  dir.write("musicnet_metadata.csv",
            "\"id\",\"composer\",\"composition\",\"movement\",\"ensemble\",\"seconds\"\n"
            "1,\"Bach\",\"Suite, \"\"No 1\"\"\",\"1. Prelude\",\"Solo Cello\",61\n"
            "2,\"Bach\",\"Broken\",\"2\",\"Solo Cello\",10\n"
            "3,\"Bach\",\"No file\",\"3\",\"Solo Cello\",10\n"
            "4,\"Haydn\",\"Quartet\",\"4. Finale\",\"String Quartet\",7.5\n");
  dir.write("Bach/1_suite.mid", one_note(60));
  dir.write("Bach/2_broken.mid", "MThd");
  dir.write("Haydn/4_quartet.MID", one_note(62));
  std::vector<std::string> warnings;
  // Python: random.Random(29).shuffle(['1', '2', '4']) gives ['2', '1', '4'].
  const MidiTextCorpus c = musicnet_midi_text(dir.path, {.seed = 29, .max_files = 2},
                                              [&](const std::string& m) { warnings.push_back(m); });
  EXPECT_EQ(c.pieces, (std::vector<std::string>{"Bach/1_suite.mid", "Haydn/4_quartet.MID"}));
  ASSERT_EQ(c.skipped.size(), 1u);
  EXPECT_NE(c.skipped[0].find("Bach/2_broken.mid"), std::string::npos);
  EXPECT_EQ(c.text.substr(0, kMusicnetTextFirstLine.size()), kMusicnetTextFirstLine);
  EXPECT_NE(c.text.find("\n\nPIECE=0000|ID=1|SEC=61.00|COMP=Bach|ENS=Solo_Cello|"
                        "WORK=Suite,__No_1_|MOVE=1._Prelude| d000.on060.v100.c0 d025.off060.c0\n"
                        "PIECE=0001|ID=4|SEC=7.50|COMP=Haydn|"),
            std::string::npos)
      << c.text;
  // Fewer readable pieces than asked for: a warning, not silence.
  warnings.clear();
  EXPECT_EQ(musicnet_midi_text(dir.path, {.seed = 29, .max_files = 5},
                               [&](const std::string& m) { warnings.push_back(m); })
                .pieces.size(),
            2u);
  EXPECT_NE(warnings.back().find("fewer than the 5"), std::string::npos);
  // two files with one id: the first in sorted order, and a warning naming both
  dir.write("Haydn/4_quartet_copy.mid", one_note(64));
  warnings.clear();
  EXPECT_EQ(musicnet_midi_text(dir.path, {.seed = 29, .max_files = 2},
                               [&](const std::string& m) { warnings.push_back(m); })
                .pieces.back(),
            "Haydn/4_quartet.MID");
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings.front().find("both carry id 4"), std::string::npos) << warnings.front();
  EXPECT_THROW(musicnet_midi_text(dir.path / "missing", {}), InputError);
}
