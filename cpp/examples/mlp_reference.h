// The problem cpp/examples/embed_zero.cpp trains, and its reference: the
// data, the MLP's sizes and initial params, AdamW's settings, and the same
// training written out in double on the whole batch, one process, plain
// scalar code with no zerocore. Apart from the trainer, so that the example
// shows what embedding takes and the oracle it is checked against stays
// independent of it.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

constexpr int kIn = 12, kHidden = 40, kOut = 6, kBatch = 16, kSteps = 6;
// AdamW (decoupled weight decay), with eps near the grads' size, so the check also sees a wrong grad scale.
constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-2, kWeightDecay = 0.01;

// The data: fixed inputs and the targets of a fixed smooth function.
inline float input(int sample, int i) { return std::sin(0.37f * float(sample * kIn + i)); }
inline float target(int sample, int o) { return std::cos(0.11f * float(sample + 3 * o)); }

// The initial params [W1, b1, W2, b2].
inline std::vector<float> initial_params() {
  std::vector<float> init;
  for (int i = 0; i < kIn * kHidden + kHidden + kHidden * kOut + kOut; ++i) {
    init.push_back(0.3f * std::sin(1.7f * float(i) + 0.5f));
  }
  return init;
}

// The same training in double on the whole batch, one process, no zerocore:
// the MLP's forward and backward and AdamW (decoupled weight decay, bias-
// corrected moments) written out. Returns the params after kSteps, in the
// order of initial_params(), and every step's loss.
inline std::vector<double> reference_train(std::vector<double>* losses) {
  const std::vector<float> init = initial_params();
  std::vector<double> p(init.begin(), init.end()), m(p.size(), 0.0), v(p.size(), 0.0);
  double* w1 = p.data();
  double* b1 = w1 + kIn * kHidden;
  double* w2 = b1 + kHidden;
  double* b2 = w2 + kHidden * kOut;
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<double> g(p.size(), 0.0);
    double* g_w1 = g.data();
    double* g_b1 = g_w1 + kIn * kHidden;
    double* g_w2 = g_b1 + kHidden;
    double* g_b2 = g_w2 + kHidden * kOut;
    double loss = 0.0;
    for (int s = 0; s < kBatch; ++s) {
      double h[kHidden], d_h[kHidden] = {};
      for (int j = 0; j < kHidden; ++j) {
        double acc = b1[j];
        for (int i = 0; i < kIn; ++i) acc += w1[j * kIn + i] * input(s, i);
        h[j] = std::max(acc, 0.0);
      }
      for (int o = 0; o < kOut; ++o) {
        double out = b2[o];
        for (int j = 0; j < kHidden; ++j) out += w2[o * kHidden + j] * h[j];
        const double e = out - target(s, o);
        loss += e * e / (kBatch * kOut);
        const double d_out = 2.0 * e / (kBatch * kOut);
        g_b2[o] += d_out;
        for (int j = 0; j < kHidden; ++j) {
          g_w2[o * kHidden + j] += d_out * h[j];
          d_h[j] += d_out * w2[o * kHidden + j];
        }
      }
      for (int j = 0; j < kHidden; ++j) {
        if (h[j] <= 0.0) continue;
        g_b1[j] += d_h[j];
        for (int i = 0; i < kIn; ++i) g_w1[j * kIn + i] += d_h[j] * input(s, i);
      }
    }
    losses->push_back(loss);
    for (size_t k = 0; k < p.size(); ++k) {
      p[k] *= 1.0 - kLr * kWeightDecay;
      m[k] = kBeta1 * m[k] + (1.0 - kBeta1) * g[k];
      v[k] = kBeta2 * v[k] + (1.0 - kBeta2) * g[k] * g[k];
      const double m_hat = m[k] / (1.0 - std::pow(kBeta1, step));
      const double v_hat = v[k] / (1.0 - std::pow(kBeta2, step));
      p[k] -= kLr * m_hat / (std::sqrt(v_hat) + kEps);
    }
  }
  return p;
}
